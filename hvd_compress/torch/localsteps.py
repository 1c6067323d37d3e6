"""Local SGD and Delayed Gradient Averaging for the PyTorch optimizer.

The rules are :mod:`hvd_compress.localsteps`'; these are their PyTorch forms,
small strategies around the optimizer's session (:mod:`hvd_compress.session`), with the same
methods as TensorFlow's (:mod:`hvd_compress.tensorflow.localsteps`):
``step`` (what ``optimizer.step()`` does), ``average`` / ``drain``, and the
state they add to ``state_dict()``.  Local SGD's averaging may be DiLoCo's outer step,
one fragment at a time (:mod:`hvd_compress.core.outer`).
"""

from __future__ import annotations

from collections import deque

import torch

from ..core import build
from ..core.outer import OUTER_MOMENTUM, StreamingSchedule, nesterov_step, split_fragments
from ..localsteps import check_outer_args
from .backend import TorchBackend
from .compressors import emptied_state as emptied


class LocalSGD:
    """Each backward pass is followed by the worker's own step; every ``period`` steps
    (after ``warmup`` synchronous ones) the workers average their parameters --
    compressed, their change since the last average, with error feedback -- and
    their floating-point buffers.

    ``session``: the optimizer's :class:`~hvd_compress.session.Session` (step count,
    schedule, account); ``params`` and ``names`` (parameter -> name): what it averages;
    ``comp``: the optimizer's compression; ``base_step(closure)``: the wrapped
    optimizer's own step; ``exchange_all(src)``: the compressed exchange of the
    tensors in ``src`` (every group's members there), averages left there.

    DiLoCo (:mod:`hvd_compress.core.outer`): ``outer_lr`` set, a sync sends each
    rank's pseudo-gradient ``anchor - p`` (through the compressor, error feedback as
    above), takes one outer Nesterov step (``outer_lr``, ``outer_momentum``) on the
    anchors with the mean, and every rank restarts from them.  ``fragments=F``
    (Streaming DiLoCo; also without ``outer_lr``: fragment-wise local SGD): the
    parameters in exchange order cut into F runs of about equal size
    (:func:`~hvd_compress.core.outer.split_fragments`), one run synced every
    ``period / F`` steps in turn (:class:`~hvd_compress.core.outer.StreamingSchedule`),
    the float buffers with the last run.  After ``warmup`` compressed synchronous
    steps the compressor's residuals (of gradients) are emptied before the first local
    step: error feedback on parameter changes starts from zero (a period changed by
    ``set_backward_passes_per_step`` must stay a multiple of F: the next step raises
    ValueError otherwise).  One worker alone takes the outer step on its own
    pseudo-gradient, uncompressed."""

    def __init__(self, session, params, names, comp, named_buffers, base_step, exchange_all,
                 outer_lr=None, outer_momentum=OUTER_MOMENTUM, fragments=1):
        self.session, self.params, self.names, self.comp = session, params, names, comp
        self.schedule = session.schedule
        self.buffers = [(k, b) for k, b in (named_buffers or ())
                        if b.is_floating_point() and b.numel() > 0]
        self._base_step, self._exchange_all = base_step, exchange_all
        self.anchors = None  # parameters after the last average (compressed, DiLoCo)
        self.outer_lr, self.outer_momentum = outer_lr, float(outer_momentum)
        order = [p for group in session.groups for p in group]  # the exchange order
        check_outer_args(True, outer_lr, outer_momentum, fragments, session.schedule.period,
                         len(order))
        self.fragments = [[order[i] for i in run]
                          for run in split_fragments([p.numel() for p in order], fragments)]
        self.synced = 0     # fragment syncs so far: the schedule's position
        self.momenta = {}   # parameter -> its outer Nesterov buffer
        self.streaming()    # (the period is a multiple of the fragments)

    @property
    def anchored(self) -> bool:
        """Whether averages start from anchors (compressed, or DiLoCo's outer step)."""
        return self.outer_lr is not None or not self.comp.passthrough

    def streaming(self, period=None) -> StreamingSchedule:
        """The fragments' schedule for the current period (or ``period``)."""
        sched = self.schedule
        return StreamingSchedule(sched.period if period is None else period,
                                 len(self.fragments), sched.warmup)

    def describe(self) -> str:
        """The outer settings as the exchange plan shows them."""
        lr = "off" if self.outer_lr is None else repr(float(self.outer_lr))
        return f"outer_lr={lr},outer_momentum={self.outer_momentum!r}," \
               f"fragments={len(self.fragments)}"

    def step(self, closure):
        s = self.session
        if self.anchored and self.anchors is None:  # the first local step
            if s.steps and not self.comp.passthrough:  # after a compressed warm-up:
                # its gradients' residuals must not enter the parameters' exchange
                self.comp.load_state_dict(emptied(self.comp.state_dict()))
            self._ensure_anchors()  # where every rank stands
        loss = self._base_step(closure)
        step = s.steps
        s.steps += 1
        alone_too = self.outer_lr is not None  # DiLoCo's outer step on one worker as well
        if self.streaming().syncs_after(step) and \
                (s.exchanges() if alone_too else s.communicates()):
            self.sync()
        s.close_step()
        return loss

    def sync(self):
        """The schedule's next fragment syncs now (every parameter with one fragment);
        the buffers go with the last fragment."""
        f = self.streaming().fragment(self.synced)
        self.synced += 1
        self._sync(self.fragments[f], buffers=f == len(self.fragments) - 1)

    def average(self):
        """Average the parameters and float buffers over the ranks now.  Uncompressed: the
        parameters' exact mean; compressed: each rank's change since the last average
        goes through the compressor and all ranks add the mean change to the anchors;
        DiLoCo: one outer step of every fragment (the schedule's position stays)."""
        self._sync([p for run in self.fragments for p in run], buffers=True)

    def _sync(self, params, buffers: bool):
        if self.outer_lr is None and self.comp.passthrough:
            self._allreduce_in_place([(self.names[p], p.data) for p in params])
        elif self.outer_lr is None:
            self._ensure_anchors()
            deltas = {p: p.detach() - self.anchors[p] for p in params}
            self._exchange_all(deltas)
            with torch.no_grad():
                for p in params:
                    self.anchors[p].add_(deltas[p])
                    p.copy_(self.anchors[p])
        else:
            self._outer_step(params)
        if buffers and self.session.communicates():
            self._allreduce_in_place(self.buffers)

    def _outer_step(self, params):
        """DiLoCo: the mean pseudo-gradient ``anchor - p`` moves the anchors by one
        Nesterov step (:func:`~hvd_compress.core.outer.nesterov_step`); p = anchor."""
        self._ensure_anchors()
        grads = {p: self.anchors[p] - p.detach() for p in params}
        if self.session.communicates():
            self._exchange_all(grads)
        with torch.no_grad():
            for p in params:
                self.anchors[p], self.momenta[p] = nesterov_step(
                    self.anchors[p], grads[p], self.momenta.get(p), self.outer_lr,
                    self.outer_momentum)
                p.copy_(self.anchors[p])

    def _ensure_anchors(self):
        if self.anchors is None:
            self.anchors = {p: p.detach().clone() for p in self.params}

    def _allreduce_in_place(self, named):
        """Tensors averaged in place, uncompressed, one collective each (all in flight)."""
        self.session.average_dense([t for _, t in named], [f"local.{k}" for k, _ in named],
                                   lambda: build("none", backend=TorchBackend()))

    def state_dict(self) -> dict:
        out = {}
        if self.anchors is not None:
            out["anchors"] = {self.names[p]: a.clone() for p, a in self.anchors.items()}
        if self.outer_lr is not None or len(self.fragments) > 1:
            out["outer"] = {"synced": self.synced,
                            "momenta": {self.names[p]: b.clone() for p, b in self.momenta.items()}}
        return out

    def load_state_dict(self, sd: dict) -> None:
        by_name = {n: p for p, n in self.names.items()}
        if "anchors" in sd:
            self.anchors = {by_name[n]: a.clone() for n, a in sd["anchors"].items()}
        if "outer" in sd:
            self.synced = int(sd["outer"]["synced"])
            self.momenta = {by_name[n]: b.clone() for n, b in sd["outer"]["momenta"].items()}


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
