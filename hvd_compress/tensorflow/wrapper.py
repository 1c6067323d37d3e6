"""What the TensorFlow tape and Keras optimizer share beyond their session: what they
were made with (:class:`Settings`), which compressor holds a tape's state, and what
comes before each exchange.

TensorFlow code makes a new tape every step.  A compressor object given as
``compression`` keeps its state across the tapes it is given to; a spec string's
(or a per-tensor choice's) state -- residuals, and the wrapper's own accumulators,
counters and DGA's queue (:mod:`.wrapperstate`) -- belongs to the variables the tape
differentiates (see :func:`~.compressors.owned_by`), so tapes over one model share it
and tapes over different models never do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.policy import Policy
from .compressors import TFCompressor, TFPolicy, as_compression, owned_by, prepare_exchange
from .exchange import plan, session

__all__ = ["Settings", "state_holder", "before_exchange"]


@dataclass(frozen=True)
class Settings:
    """The exchange settings a tape or Keras optimizer was made with (Horovod's
    arguments and ours): what its :class:`~hvd_compress.session.Session` and its plan
    are made from."""

    op: Any
    gradient_predivide_factor: float
    process_set: Any
    hierarchical: bool | None
    local_sgd: bool
    backward_passes_per_step: int
    warmup: int          # local_sgd_warmup_steps
    delay: int           # DGA's D
    buffers: tuple = ()  # local SGD's averaged buffers
    exchange: str = "auto"  # how payloads travel (:func:`hvd_compress.session.resolve_exchange`)

    def session(self):
        """A new session (:func:`~.exchange.session`) with these settings."""
        return session(self.op, self.gradient_predivide_factor, self.process_set,
                       self.hierarchical, self.local_sgd, self.backward_passes_per_step,
                       self.warmup, self.delay, self.exchange)

    def plan(self, wrapper: str, comp, grads, names, **more) -> dict:
        """The exchange plan of ``wrapper`` (its name) running ``comp`` on ``grads``
        (named ``names``), as :func:`~.exchange.plan` makes it."""
        return plan(wrapper, comp, self.op, self.gradient_predivide_factor,
                    self.backward_passes_per_step, grads, names, self.local_sgd,
                    self.warmup, self.delay, self.buffers, **more)


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
