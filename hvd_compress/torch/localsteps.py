"""Local SGD and Delayed Gradient Averaging for the PyTorch optimizer.

The rules are :mod:`hvd_compress.localsteps`'; these are their PyTorch forms,
small strategies around the optimizer's session (:mod:`hvd_compress.session`), with the same
methods as TensorFlow's (:mod:`hvd_compress.tensorflow.localsteps`):
``step`` (what ``optimizer.step()`` does), ``average`` / ``drain``, and the
state they add to ``state_dict()``.
"""

from __future__ import annotations

from collections import deque

import torch

from ..core import build
from .backend import TorchBackend


class LocalSGD:
    """Each backward pass is followed by the worker's own step; every ``period`` steps
    (after ``warmup`` synchronous ones) the workers average their parameters --
    compressed, their change since the last average, with error feedback -- and
    their floating-point buffers.

    ``session``: the optimizer's :class:`~hvd_compress.session.Session` (step count,
    schedule, account); ``params`` and ``names`` (parameter -> name): what it averages;
    ``comp``: the optimizer's compression; ``base_step(closure)``: the wrapped
    optimizer's own step; ``exchange_all(src)``: the compressed exchange of every
    group's tensors in ``src``, averages left there."""

    def __init__(self, session, params, names, comp, named_buffers, base_step, exchange_all):
        self.session, self.params, self.names, self.comp = session, params, names, comp
        self.schedule = session.schedule
        self.buffers = [(k, b) for k, b in (named_buffers or ())
                        if b.is_floating_point() and b.numel() > 0]
        self._base_step, self._exchange_all = base_step, exchange_all
        self.anchors = None  # parameters after the last average (compressed)

    def step(self, closure):
        s = self.session
        if not self.comp.passthrough:
            self._ensure_anchors()  # before the first local step: where every rank stands
        loss = self._base_step(closure)
        step = s.steps
        s.steps += 1
        if s.averages_now(step) and s.communicates():
            self.average()
        s.close_step()
        return loss

    def average(self):
        """Average the parameters and float buffers over the ranks now.  Uncompressed: the
        parameters' exact mean; compressed: each rank's change since the last average
        goes through the compressor and all ranks add the mean change to the anchors."""
        params = self.params
        if self.comp.passthrough:
            self._allreduce_in_place([(self.names[p], p.data) for p in params])
        else:
            self._ensure_anchors()
            deltas = {p: p.detach() - self.anchors[p] for p in params}
            self._exchange_all(deltas)
            with torch.no_grad():
                for p in params:
                    self.anchors[p].add_(deltas[p])
                    p.copy_(self.anchors[p])
        self._allreduce_in_place(self.buffers)

    def _ensure_anchors(self):
        if self.anchors is None:
            self.anchors = {p: p.detach().clone() for p in self.params}

    def _allreduce_in_place(self, named):
        """Tensors averaged in place, uncompressed, one collective each (all in flight)."""
        s = self.session
        s.ready_engine()  # the ranks' plans agree (checked once, before any collective)
        engine = s.dense_engine(lambda: build("none", backend=TorchBackend()))
        batches = [engine.send([t], [f"local.{k}"], s.stats) for k, t in named]
        engine.receive(batches, s.stats, outs=[[t] for _, t in named])

    def state_dict(self) -> dict:
        if self.anchors is None:
            return {}
        return {"anchors": {self.names[p]: a.clone() for p, a in self.anchors.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if "anchors" in sd:
            by_name = {n: p for p, n in self.names.items()}
            self.anchors = {by_name[n]: a.clone() for n, a in sd["anchors"].items()}


class DelayedAveraging:
    """DGA: step i's collectives start from a snapshot of the local gradients and are
    collected at step i + D, where the update uses ``g_i - g_{i-D} + avg(g_{i-D})``.

    ``path``: the optimizer's :class:`~.grads.GradientPath` (it sends the groups whose
    hooks did not fire, gives ``p``'s gradient as sent and finishes batches into a
    destination); ``base_step(closure)``: the wrapped optimizer's own step."""

    def __init__(self, session, delay: int, path, base_step):
        self.session, self.delay = session, delay
        self._launch, self._grad, self._collect = path.launch, path.grad, path.collect
        self._base_step = base_step
        path.dga = self
        self.inflight = deque()  # (batches in flight, local gradients) per step
        self.snapshots = {}      # this step's local gradients
        self.tag = ""            # collective names differ between steps in flight

    def keep(self, group, grads):
        """This step's gradients of ``group``, copied: needed D steps later, unchanged."""
        kept = [g.detach().clone() for g in grads]
        self.snapshots.update(zip(group, kept))
        return kept

    def step(self, closure):
        s = self.session
        s.send_missing(self._launch)
        self.inflight.append((s.take_pending(), self.snapshots))
        self.snapshots = {}
        s.reset_passes()
        if len(self.inflight) > self.delay:
            pending, stale = self.inflight.popleft()
            with torch.no_grad():
                for p, g_old in stale.items():  # g_i - g_{i-D} ...
                    self._grad(p).sub_(g_old)
                self._collect(pending, dest=stale)  # avg(g_{i-D}) into the old buffers
                for p, avg_old in stale.items():  # ... + avg(g_{i-D})
                    p.grad.add_(avg_old)
        s.steps += 1
        self.tag = f".d{s.steps % (self.delay + 1)}"
        s.close_step()
        return self._base_step(closure)

    def drain(self):
        """Wait for the collectives still in flight (their averages are not applied)."""
        while self.inflight:
            pending, stale = self.inflight.popleft()
            self._collect(pending, dest=stale)
        self.session.close_step()
