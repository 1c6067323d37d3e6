"""Elastic Horovod (``hvd.elastic.run``, ``hvd.elastic.TorchState``) with our optimizer.

Horovod's elastic loop, on a ``HorovodInternalError``, restores the last
committed state; on that error or a ``HostsUpdatedInterrupt`` it shuts Horovod
down, initialises it again for the new set of workers (new size, possibly new
ranks) and, unless only workers left, syncs the state from rank 0.  Its
``TorchState`` saves and restores an optimizer with ``state_dict()`` /
``load_state_dict()`` -- ours carries its compressor state there, so a restore
rolls that back too -- and syncs it with ``broadcast_optimizer_state``, which
sends only the wrapped optimizer's per-parameter state.

This module adds what our optimizer needs on top, with nothing for the user to
call: importing :mod:`hvd_compress.torch` puts :class:`OptimizerStateHandler` in
front of Horovod's handler registry for our optimizers, and the optimizer
follows a new world by itself at its next exchange.

**The world-size rule.**  After a reset the optimizer follows the new world: its
compressors are bound to the new rank and size (PowerSGD averages its ``Q`` over
the new size, DGC clips for it), the ranks agree on the exchange plan again (a
worker that joined takes part), and gradient hooks are registered once there is
more than one rank.  Compressor state is split in two:

* *per-rank state* (:data:`PER_RANK`: error-feedback residuals, DGC's momentum
  ``u`` and velocity ``v``, Signum's momentum, a stochastic quantizer's own noise
  generator) stays with the process that made it.  A surviving worker keeps
  its own (after a ``HorovodInternalError``: the copy committed last, as the
  model); a worker that joins starts from zero, as a fresh optimizer does; a
  worker that leaves takes its residuals with it -- the gradient it had not
  yet sent is lost.
* *shared state* (everything else: per-tensor ``step`` counters, which key
  Random-k's indices, DGC's warm-up and sampling; PowerSGD's warm-start ``Q``;
  the per-tensor policy's step; the optimizer's step count) must be equal on
  every rank.  The sync takes it from rank 0 (one ``broadcast_object`` after
  Horovod's ``broadcast_optimizer_state``).  Where Horovod skips the sync
  (workers only left), the survivors' shared state is already equal.

Elastic training is supported over the global process set (Horovod initialises
no other after a reset); ``local_sgd`` and ``delay`` are refused at the first
sync (their state is not elastic yet).
"""

from __future__ import annotations

import os

import torch
from horovod.torch.elastic import state as _hvd_state

from ..core.base import PER_RANK_STATE

__all__ = ["OptimizerStateHandler", "PER_RANK", "follow_world", "sync_compressor_state",
           "shared_state", "merge_state", "install"]

#: per-tensor compressor state that belongs to one rank (module docstring; the core's one
#: list); a compressor's ``extra`` state (its own noise generator, seeded by rank) is
#: per-rank too
PER_RANK = PER_RANK_STATE


class _Placeholder:
    """A per-rank tensor left out of rank 0's shared state: its shape and dtype."""

    def __init__(self, tensor):
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def zeros(self):
        return torch.zeros(self.shape, dtype=self.dtype)


def is_ours(opt) -> bool:
    """Whether ``opt`` is a :func:`hvd_compress.torch.DistributedOptimizer`."""
    return isinstance(opt, torch.optim.Optimizer) and getattr(opt, "_hvd_compress", False)


def follow_world(opt, reset: bool = False) -> None:
    """Bind ``opt`` to Horovod's current rank and size if they changed since it last
    looked (its session does; called before each exchange, cheap when nothing changed).
    ``reset``: a sync after an elastic reset, on every rank at once -- also forget the
    plan the ranks agreed on (a worker may have joined) and any exchange in flight."""
    opt.hvd_compress_session.follow_world(opt.compression, reset)


def shared_state(sd: dict) -> dict:
    """A compressor's (or per-tensor policy's) ``state_dict()`` without its per-rank
    part: per-rank tensors become placeholders, ``extra`` and the two-phase ``owner``'s
    state (the residuals of the chunks this rank owns) are left out."""
    if "compressors" in sd:  # a per-tensor policy
        return {**sd, "compressors": {k: shared_state(v) for k, v in sd["compressors"].items()}}
    out = {k: v for k, v in sd.items() if k not in ("tensors", "extra", "owner")}
    out["tensors"] = {name: {k: _Placeholder(v) if k in PER_RANK else v for k, v in st.items()}
                      for name, st in sd.get("tensors", {}).items()}
    return out


def merge_state(shared: dict, mine: dict) -> dict:
    """Rank 0's ``shared`` state with this rank's per-rank state from ``mine`` (its own
    ``state_dict()``): kept where this rank has the tensor (same size), zero where not."""
    if "compressors" in shared:
        own = mine.get("compressors", {})
        return {**shared, "compressors": {k: merge_state(v, own.get(k, {}))
                                          for k, v in shared["compressors"].items()}}
    out = {k: v for k, v in shared.items() if k != "tensors"}
    for own_only in ("extra", "owner"):  # (the two-phase owner's residuals: this rank's chunks)
        if own_only in mine:
            out[own_only] = mine[own_only]
    own = mine.get("tensors", {})
    tensors = {}
    for name, st in shared["tensors"].items():
        have = own.get(name, {})
        same = have.get("numel") == st.get("numel")
        tensors[name] = {k: (v if not isinstance(v, _Placeholder) else
                             have[k] if same and k in have else v.zeros())
                         for k, v in st.items()}
    out["tensors"] = tensors
    return out


def sync_compressor_state(opt, root_rank: int = 0) -> None:
    """Every rank takes rank ``root_rank``'s shared compressor state and step count,
    keeping its own per-rank state (module docstring).  Collective: all ranks call it."""
    opt.hvd_compress_session.take_shared_state(opt.compression, root_rank, shared_state,
                                               merge_state)


class OptimizerStateHandler(_hvd_state.OptimizerStateHandler):
    """``TorchState``'s handler for our optimizers: Horovod's save and restore (the
    compressor state is in ``state_dict()``); the sync first follows the new world,
    then broadcasts as Horovod does, then the shared compressor state."""

    def sync(self):
        opt = self.value
        session = opt.hvd_compress_session
        if session.schedule is not None or session.delay:
            raise NotImplementedError("hvd_compress: elastic training with local_sgd=True or "
                                      "delay>0 is not supported (their state is not elastic)")
        follow_world(opt, reset=True)
        super().sync()
        sync_compressor_state(opt)


def _handler(value):
    """The registry entry's factory: ours for our optimizers, else the next entry's."""
    if is_ours(value):
        return OptimizerStateHandler(value)
    for kind, make in _hvd_state.get_handler_registry():
        if make is not _handler and isinstance(value, kind):
            return make(value)
    return None


def install() -> None:
    """Put our handler first in ``horovod.torch.elastic``'s handler registry (once)."""
    registry = _hvd_state.get_handler_registry()
    if not any(make is _handler for _, make in registry):
        _hvd_state.set_handler_registry([(torch.optim.Optimizer, _handler), *registry])


def elastic_launch() -> bool:
    """Whether this process was started by an elastic ``horovodrun``."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


install()
