"""Local SGD and Delayed Gradient Averaging for the PyTorch optimizer.

The rules are :mod:`hvd_compress.localsteps`'; these are their PyTorch forms,
small strategies around the optimizer's exchange engine, with the same
methods as TensorFlow's (:mod:`hvd_compress.tensorflow.localsteps`):
``step`` (what ``optimizer.step()`` does), ``average`` / ``drain``, and the
state they add to ``state_dict()``.
"""

from __future__ import annotations

from collections import deque

import torch

from ..localsteps import LocalSGDSchedule
from .agreement import ready_engine


class LocalSGD:
    """Each backward pass is followed by the worker's own step; every ``period`` steps
    (after ``warmup`` synchronous ones) the workers average their parameters --
    compressed, their change since the last average, with error feedback -- and
    their floating-point buffers."""

    def __init__(self, opt, period: int, warmup: int, named_buffers):
        self.opt = opt
        self.schedule = LocalSGDSchedule(period, warmup)
        self.buffers = [(k, b) for k, b in (named_buffers or ())
                        if b.is_floating_point() and b.numel() > 0]
        self.anchors = None  # parameters after the last average (compressed)

    def local(self, step: int) -> bool:
        """Whether step ``step`` is a worker's own (no gradient exchange)."""
        return not self.schedule.synchronous(step)

    def step(self, closure):
        opt = self.opt
        if not opt.compression.passthrough:
            self._ensure_anchors()  # before the first local step: where every rank stands
        loss = opt._base_step(closure)
        step = opt._optimizer_steps
        opt._optimizer_steps += 1
        if self.schedule.averages_after(step) and opt._communicates():
            self.average()
        opt._close_step()
        return loss

    def average(self):
        """Average the parameters and float buffers over the ranks now.  Uncompressed: the
        parameters' exact mean; compressed: each rank's change since the last average
        goes through the compressor and all ranks add the mean change to the anchors."""
        opt = self.opt
        params = opt._requires_update
        if opt.compression.passthrough:
            self._allreduce_in_place([(opt._parameter_names[p], p.data) for p in params])
        else:
            self._ensure_anchors()
            deltas = {p: p.detach() - self.anchors[p] for p in params}
            opt._exchange_all(src=deltas)
            with torch.no_grad():
                for p in params:
                    self.anchors[p].add_(deltas[p])
                    p.copy_(self.anchors[p])
        self._allreduce_in_place(self.buffers)

    def _ensure_anchors(self):
        if self.anchors is None:
            self.anchors = {p: p.detach().clone() for p in self.opt._requires_update}

    def _allreduce_in_place(self, named):
        """Tensors averaged in place, uncompressed, one collective each (all in flight)."""
        opt = self.opt
        ready_engine(opt)  # the ranks' plans agree (checked once, before any collective)
        engine, stats = opt._dense_engine(), opt.comm_stats
        batches = [engine.send([t], [f"local.{k}"], stats) for k, t in named]
        engine.receive(batches, stats, outs=[[t] for _, t in named])

    def state_dict(self) -> dict:
        if self.anchors is None:
            return {}
        return {"anchors": {self.opt._parameter_names[p]: a.clone()
                            for p, a in self.anchors.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if "anchors" in sd:
            by_name = {n: p for p, n in self.opt._parameter_names.items()}
            self.anchors = {by_name[n]: a.clone() for n, a in sd["anchors"].items()}


class DelayedAveraging:
    """DGA: step i's collectives start from a snapshot of the local gradients and are
    collected at step i + D, where the update uses ``g_i - g_{i-D} + avg(g_{i-D})``."""

    def __init__(self, opt, delay: int):
        self.opt = opt
        self.delay = delay
        self.inflight = deque()  # (batches in flight, local gradients) per step
        self.snapshots = {}      # this step's local gradients
        self.tag = ""            # collective names differ between steps in flight

    def keep(self, group, grads):
        """This step's gradients of ``group``, copied: needed D steps later, unchanged."""
        kept = [g.detach().clone() for g in grads]
        self.snapshots.update(zip(group, kept))
        return kept

    def step(self, closure):
        opt = self.opt
        opt._launch_missing()
        self.inflight.append((dict(opt._pending), self.snapshots))
        opt._pending.clear()
        opt._ready.clear()
        self.snapshots = {}
        opt._reset_passes()
        if len(self.inflight) > self.delay:
            pending, stale = self.inflight.popleft()
            with torch.no_grad():
                for p, g_old in stale.items():  # g_i - g_{i-D} ...
                    opt._grad(p).sub_(g_old)
                opt._collect(pending, dest=stale)  # avg(g_{i-D}) into the old buffers
                for p, avg_old in stale.items():  # ... + avg(g_{i-D})
                    p.grad.add_(avg_old)
        opt._optimizer_steps += 1
        self.tag = f".d{opt._optimizer_steps % (self.delay + 1)}"
        opt._close_step()
        return opt._base_step(closure)

    def drain(self):
        """Wait for the collectives still in flight (their averages are not applied)."""
        while self.inflight:
            pending, stale = self.inflight.popleft()
            self.opt._collect(pending, dest=stale)
        self.opt._close_step()

