"""DiLoCo's outer step and Streaming DiLoCo's fragments: framework-neutral rules.

**DiLoCo** (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", 2023): local SGD whose averaging is an *outer* optimizer step.
Every worker trains on its own for ``H`` steps from the shared point ``anchor``; then
the *pseudo-gradient* ``g = anchor - mean_r(p_r)`` (every worker sends its own
``anchor - p_r``; a compressor may carry it, with error feedback) moves the anchor by
one Nesterov SGD step, and every worker restarts from the new anchor.  The paper's
outer learning rate is 0.7, its momentum 0.9 (:data:`OUTER_LR`, :data:`OUTER_MOMENTUM`).

**Streaming DiLoCo** (Douillard et al., "Streaming DiLoCo with overlapping
communication", 2025): the parameters are cut into ``F`` fragments, each synced (its
pseudo-gradient, its outer step, its own momentum) every ``H`` steps, fragment ``f``
staggered so that one fragment syncs every ``H / F`` steps: the peak bandwidth falls
by ``F``.  :class:`StreamingSchedule` is torchft's order (``torchft/local_sgd.py``,
``DiLoCo`` with ``model_fragments``): after local steps ``H/F``, ``2H/F``, ... the
fragments ``0, 1, ..., F-1, 0, 1, ...`` sync in turn.  The paper's overlap of that
communication with the next ``tau`` inner steps and its mixing ``alpha`` of local
and global parameters are not part of these rules (``tau = 0``, ``alpha = 0``).

Only operators every array type has (``*``, ``+``, ``-``) touch the tensors, so numpy
arrays, torch tensors and TensorFlow tensors all take :func:`nesterov_step`.
"""

from __future__ import annotations

__all__ = ["OUTER_LR", "OUTER_MOMENTUM", "nesterov_step", "split_fragments",
           "StreamingSchedule"]

#: the DiLoCo paper's outer learning rate and Nesterov momentum
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def nesterov_step(anchor, grad, buf, lr: float, momentum: float):
    """One outer Nesterov SGD step on ``anchor`` for the pseudo-gradient ``grad``;
    returns ``(new anchor, new momentum buffer)``.

    ``torch.optim.SGD(lr, momentum, nesterov=True)``'s rule (no dampening, no weight
    decay): ``buf = momentum * buf + grad`` (``buf = grad`` at the first step, ``buf``
    None), ``anchor - lr * (grad + momentum * buf)``.  Each product and sum is rounded
    on its own, in the tensors' dtype (no fused multiply-add: numpy and every
    framework give the same bits).  Nothing is changed in place; the returned buffer
    may be ``grad`` itself."""
    buf = grad if buf is None else buf * momentum + grad
    return anchor - (grad + buf * momentum) * lr, buf


def split_fragments(sizes, count: int) -> list:
    """Indices ``0..len(sizes)-1`` (tensors in exchange order, ``sizes`` their element
    counts) cut into ``count`` runs of consecutive tensors, each run's total as close
    as the cuts allow to ``sum(sizes) / count`` (every run non-empty but where there
    is no tensor and one run; a tie takes the earlier cut).  Returns the runs, as lists
    of indices, in order."""
    n, count = len(sizes), int(count)
    if count == 1:  # (also no tensor at all: one empty run)
        return [list(range(n))]
    if not 1 <= count <= n:
        raise ValueError(f"fragments must be between 1 and the number of tensors ({n}), "
                         f"got {count}")
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + int(s))
    total, cuts, start = cum[-1], [], 0
    for f in range(1, count):
        target = total * f / count
        # the cut after start, leaving at least one tensor to each later run
        start = min(range(start + 1, n - (count - f) + 1), key=lambda e: abs(cum[e] - target))
        cuts.append(start)
    return [list(range(a, b)) for a, b in zip([0] + cuts, cuts + [n])]


class StreamingSchedule:
    """After which local steps a fragment syncs, and which one.

    ``period`` (``H``) is a multiple of ``fragments`` (``F``); local steps count from
    0 after ``warmup`` synchronous ones.  A fragment syncs after local step ``k`` when
    ``k + 1`` is a multiple of ``H / F``; the ``n``-th sync (``n`` from 0, counted by
    the caller) is fragment ``n % F``.  So fragment ``f`` first syncs after
    ``(f + 1) H / F`` local steps, then every ``H``.  ``F = 1``: plain DiLoCo, every
    ``H`` steps.  ``syncs_after`` uses only ``<``, ``>=``, ``%``, ``-``, ``+`` and
    ``&``: it works on Python ints and on integer tensors (TF graphs)."""

    def __init__(self, period: int, fragments: int = 1, warmup: int = 0):
        self.period, self.fragments, self.warmup = int(period), int(fragments), int(warmup)
        if self.fragments < 1 or self.period % self.fragments:
            raise ValueError(f"the period ({self.period}) must be a multiple of fragments "
                             f"({self.fragments})")
        self.interval = self.period // self.fragments

    def syncs_after(self, step):
        """Whether a fragment syncs after optimizer step ``step`` (0-based, warm-up
        included)."""
        return (step >= self.warmup) & ((step - self.warmup + 1) % self.interval == 0)

    def fragment(self, synced: int) -> int:
        """The fragment of the sync that ``synced`` syncs came before."""
        return synced % self.fragments

    def __repr__(self) -> str:
        return (f"StreamingSchedule(period={self.period}, fragments={self.fragments}, "
                f"warmup={self.warmup})")
