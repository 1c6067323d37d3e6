"""What the TensorFlow tape and Keras optimizer share beyond their session: which
compressor holds a tape's state, and what comes before each exchange.

TensorFlow code makes a new tape every step.  A compressor object given as
``compression`` keeps its state across the tapes it is given to; a spec string's
(or a per-tensor choice's) state -- residuals, accumulators, counters, DGA's queue --
belongs to the variables the tape differentiates (see
:func:`~.compressors.owned_by`), so tapes over one model share it and tapes over
different models never do."""

from __future__ import annotations

from ..core.policy import Policy
from .compressors import TFCompressor, TFPolicy, as_compression, owned_by, prepare_exchange

__all__ = ["state_holder", "before_exchange"]


def state_holder(compression, variables, min_numel: int, start_step: int):
    """The compressor (or per-tensor policy) that holds the state of a tape given
    ``compression`` (a compressor or policy object, or a choice) over ``variables``."""
    if isinstance(compression, TFPolicy):
        return compression
    given = compression if isinstance(compression, TFCompressor) else None

    def make():
        return as_compression(compression, min_numel, start_step)
    if given is not None and Policy(given.spec, min_numel, start_step).uniform:
        return given  # the compressor itself
    if not variables:
        return make()
    # the policy (and its counters) belong to the variables
    key = f"{Policy(given.spec if given else compression, min_numel, start_step)}" \
          f"@{id(given) if given is not None else ''}" \
          f"@{id(compression) if callable(compression) and given is None else ''}"
    return owned_by(variables, key, make)


def before_exchange(session, grads, names, plan) -> None:
    """Before ``session`` exchanges ``grads`` (named ``names``): a per-tensor policy
    settles its choices; the compressor is bound to the world and, after
    :func:`~.compressors.broadcast_compression_state`, takes the root's shared state
    (the ranks then check their plan again); the ranks agree on ``plan()``."""
    comp = session.engine.comp
    if isinstance(comp, TFPolicy):
        comp.settle([(n, tuple(g.shape), g.dtype.name) for g, n in zip(grads, names)])
    if prepare_exchange(comp, grads, names, session.process_set):
        session.forget_agreement()  # (a new sync: ranks may have joined)
    session.agree(plan)  # at the first exchange of these tensors
