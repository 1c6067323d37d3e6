"""``hvd_compress.torch.DistributedOptimizer``: Horovod's optimizer, with every compressor.

A drop-in replacement for ``horovod.torch.DistributedOptimizer`` (0.28.1): the
same arguments, defaults and behaviour -- gradient hooks start communication
during the backward pass, ``synchronize()``/``skip_synchronize()``,
``backward_passes_per_step``, ``op``, ``gradient_predivide_factor``,
``groups``/``num_groups``, ``sparse_as_dense``, ``process_set``.  This module is
the Horovod integration only: a group's gradients go to the exchange engine
(:mod:`hvd_compress.core.exchange`, which picks the collective each compressor
needs, runs PowerSGD's rounds, decodes and averages) once all of them are
ready; local SGD and DGA are strategies in :mod:`.localsteps`.  Compressor state
is saved with ``state_dict()``; :attr:`comm_stats` accounts bytes and times.

**DGC and momentum.** DGC applies momentum inside the compressor (momentum
correction), so the wrapped optimizer must not apply it again: use
``torch.optim.SGD(momentum=0)`` and give the momentum to DGC
(``dgc:momentum=0.9``, the default).  If the wrapped optimizer has
``momentum=m > 0``, it is moved into DGC (with a warning).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import horovod.torch as hvd
import torch

from .. import nodes
from ..core import Exchange, build, new_stats
from ..core.hierarchy import Hierarchical
from ..core.policy import DEFAULT_MIN_NUMEL
from ..localsteps import check_wrapper_args
from ..pertensor import format_plan
from ..processset import check_process_set, exchanges
from .agreement import ready_engine
from .backend import TorchBackend
from .collectives import HorovodTorch
from .compressors import TorchPolicy, as_compression, pair_dgc_with_momentum
from .elastic import elastic_launch, follow_world
from .localsteps import DelayedAveraging, LocalSGD
from .params import called_by_broadcast_optimizer_state, checked_names, make_groups
from .sparse import SparseAware, densify

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(torch.optim.Optimizer):
    _hvd_compress = True  # (the classes made from this one's dict: see .elastic)

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=hvd.Average, gradient_predivide_factor=1.0, groups=None,
                 sparse_as_dense=False, process_set=hvd.global_process_set, local_sgd=False,
                 local_sgd_warmup_steps=0, named_buffers=None, delay=0, hierarchical=None):
        super(self.__class__, self).__init__(params)
        check_process_set(hvd, process_set)
        sets = None if hierarchical is False else nodes.node_sets(hvd, process_set)
        if hierarchical and sets is None:
            raise ValueError(nodes.MISSING)
        self._compression = compression
        named_parameters = checked_names(self.param_groups, named_parameters)
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        # Local SGD: backward_passes_per_step is the averaging period, each pass a local step.
        self._local = LocalSGD(self, backward_passes_per_step, local_sgd_warmup_steps,
                               named_buffers) if local_sgd else None
        self._dga = DelayedAveraging(self, delay) if delay else None
        self._optimizer_steps = 0
        self._step_unsure = True  # (see _agree_on_step)
        self._allreduce_delay = {v: self._passes() for _, v in named_parameters}
        self._pending = {}          # group -> Batch in flight
        self._ready = {}            # group -> parameters ready this step
        self._hooks = []
        self._synchronized = False
        self._should_synchronize = True
        # Empty parameters carry nothing to exchange.
        self._requires_update = [p for g in self.param_groups for p in g["params"]
                                 if p.requires_grad and p.numel() > 0]
        if isinstance(compression, TorchPolicy):
            entries = self._entries(self._requires_update)
            if not local_sgd:  # (local steps keep their own momentum)
                pair_dgc_with_momentum(self, compression, entries)
            compression.settle(entries)
            _check_args([compression.policy.spec_for(*e) for e in entries], op,
                        gradient_predivide_factor, backward_passes_per_step, local_sgd,
                        local_sgd_warmup_steps, delay, compression.policy.start_step)
        self._groups = make_groups(self._requires_update, self._parameter_names, groups)
        if isinstance(compression, TorchPolicy) and groups is None:
            self._groups = self._fuse_uncompressed(self._groups)
        self._p_to_group = {p: g for g in self._groups for p in g}
        self.comm_stats = new_stats()
        self.comm_totals = new_stats()
        self.last_stats = new_stats()
        self._dense = None
        self._world = None  # (rank, size) the compressor is bound to; see .elastic
        if process_set.included():
            self._world = (hvd.rank(), process_set.size())
            self._compression.bind(*self._world)
            if process_set.size() > 1 or elastic_launch():  # (as Horovod's: the world may grow)
                self._register_hooks()
        #: whether compressed gradients go by the hierarchical exchange (dense inside a
        #: node, compressed between nodes: :mod:`hvd_compress.core.hierarchy`)
        self.hierarchical = sets is not None
        average = op == hvd.Average
        if sets is None:
            engine = Exchange(self._compression.core, HorovodTorch(process_set), average=average,
                              predivide=gradient_predivide_factor, op=op)
        else:
            nodes.finish_together(hvd)
            engine = Hierarchical(self._compression.core, HorovodTorch(process_set),
                                  HorovodTorch(sets[0]), HorovodTorch(sets[1]), sets[2],
                                  average=average, predivide=gradient_predivide_factor, op=op)
        self._engine = SparseAware(engine, process_set, op)

    # -- the per-tensor plan ---------------------------------------------------------------
    def _entries(self, params):
        return [(self._parameter_names[p], tuple(p.shape), str(p.dtype).replace("torch.", ""))
                for p in params]

    def _fuse_uncompressed(self, groups):
        """One group for every parameter the policy sends uncompressed (one allreduce per
        step, launched once the last of them is ready), the others as they were."""
        comp, dense = self._compression, []
        rest = []
        for group in groups:
            (dense if len(group) == 1 and not comp.compresses(*self._entries(group)[0])
             else rest).append(group)
        if len(dense) < 2:
            return groups
        return [tuple(p for (p,) in dense)] + rest

    def _agree_on_step(self):
        """With a delayed start, every rank must be on the same side of it: at the first
        exchange (and after a load) the ranks take the largest step count any of them
        has (Horovod's resume pattern loads the checkpoint on rank 0 only)."""
        if not self._step_unsure or not self._compression.policy.start_step:
            return
        self._step_unsure = False
        got = hvd.allreduce(torch.tensor([self._optimizer_steps], dtype=torch.int64),
                            op=hvd.Max, name="hvd_compress.policy_step",
                            process_set=self.process_set)
        self._optimizer_steps = int(got[0])

    def plan(self) -> list:
        """Per parameter, in exchange order: name, shape, dtype, the compressor it travels
        with (once compression has started) and its payload bytes per step."""
        return self._compression.plan(self._entries([p for g in self._groups for p in g]))

    def print_plan(self, file=None) -> str:
        """Print (and return) :meth:`plan` as a table."""
        start = getattr(self._compression, "policy", None)
        text = format_plan(self.plan(), start.start_step if start is not None else 0)
        print(text, file=file, flush=True)
        return text

    # -- groups and hooks ------------------------------------------------------------------
    def _register_hooks(self):
        for p in self._requires_update:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _passes(self):
        """Backward passes summed before an exchange (one per local step in local SGD)."""
        return 1 if self._local is not None else self.backward_passes_per_step

    def _local_phase(self):
        return self._local is not None and self._local.local(self._optimizer_steps)

    def _communicates(self):
        return exchanges(hvd, self.process_set) and self.process_set.size() > 1

    def _make_hook(self, p):
        def hook(param):
            if self._local_phase():
                return
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                group = self._p_to_group[p]
                ready = self._ready.setdefault(group, set())
                ready.add(p)
                if len(ready) == len(group):
                    self._launch(group)
        return hook

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        if self._local is not None:
            self._local.schedule.period = int(passes)
        self._reset_passes()

    # -- communication -------------------------------------------------------------------------
    def _grad(self, p):
        if p.grad is None:
            # Another rank may have a gradient for it (dynamic graphs): take part with zeros.
            p.grad = torch.zeros_like(p)
        grad = p.grad
        passthrough = self._compression.passthrough_for(*self._entries([p])[0])
        if grad.is_sparse and (self.sparse_as_dense or not passthrough):  # see .sparse
            grad = densify(grad, self._parameter_names[p], not passthrough)
        return grad  # (a sparse p.grad gets the average back sparse, as in Horovod)

    def _launch(self, group, src=None):
        """Encode and send ``group``'s gradients (or the tensors ``src`` maps them to)."""
        grads = [self._grad(p) if src is None else src[p] for p in group]
        if self._dga is not None and src is None:
            grads = self._dga.keep(group, grads)
        names = [self._parameter_names[p] for p in group]
        tag = self._dga.tag if self._dga is not None else ""
        follow_world(self)  # (after an elastic reset: a new rank or size)
        if isinstance(self._compression, TorchPolicy):  # the delayed start counts these
            self._agree_on_step()
            self._compression.policy_step = self._optimizer_steps
        self._pending[group] = ready_engine(self).send(grads, names, self.comm_stats, tag)

    def _exchange_all(self, src):
        """Send every group's tensors in ``src`` and leave their averages there."""
        pending = {}
        for group in self._groups:
            self._launch(group, src=src)
            pending[group] = self._pending.pop(group)
        self._collect(pending, dest=src)

    def _dense_engine(self):
        """Uncompressed averaging for tensors that are not gradients (local SGD's buffers)."""
        if self._dense is None:
            self._dense = Exchange(build("none", backend=TorchBackend()),
                                   HorovodTorch(self.process_set), op=hvd.Average)
        return self._dense

    def synchronize(self):
        if not exchanges(hvd, self.process_set):
            self._synchronized = True
            return
        self._launch_missing()
        self._collect(self._pending)
        self._pending.clear()
        self._ready.clear()
        self._reset_passes()
        self._close_step()
        self._synchronized = True

    def _launch_missing(self):
        for group in self._groups:  # parameters whose hook did not fire this step
            if group not in self._pending:
                self._launch(group)

    def _reset_passes(self):
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self._passes()

    def _close_step(self):
        """This step's account becomes ``last_stats`` and is added to ``comm_totals``."""
        self.last_stats = dict(self.comm_stats)
        for key, value in self.comm_stats.items():
            self.comm_totals[key] += value
        self.comm_stats = new_stats()

    def _collect(self, pending, dest=None):
        """Finish the batches in ``pending`` (group -> Batch) and leave each parameter's
        average in ``p.grad`` (or in ``dest[p]``), decoded straight into it where it can."""
        groups = list(pending)
        targets = [[p.grad if dest is None else dest[p] for p in g] for g in groups]
        outs = [[t if t is not None and not t.is_sparse and t.dtype == p.dtype
                 and t.shape == p.shape else None for p, t in zip(g, ts)]
                for g, ts in zip(groups, targets)]
        results = self._engine.receive([pending[g] for g in groups], self.comm_stats, outs)
        for group, res, ts in zip(groups, results, targets):
            for p, result, target in zip(group, res, ts):
                if result is not target:
                    if dest is None:
                        self._set_grad(p, result)
                    else:
                        target.copy_(result)

    @staticmethod
    def _set_grad(p, result):
        result = result.to(p.dtype)
        if p.grad is None:
            p.grad = result
        elif p.grad.is_sparse:
            p.grad.zero_().add_(result.to_sparse())
        else:
            p.grad.copy_(result)

    @contextmanager
    def skip_synchronize(self):
        """``optimizer.step()`` inside this context does not synchronize (call
        ``optimizer.synchronize()`` yourself before, e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _base_step(self, closure):
        return super(self.__class__, self).step(closure)

    @torch.no_grad()
    def _state_init_step(self, closure):
        """The step Horovod's ``broadcast_optimizer_state`` takes, with zero gradients, on
        the ranks that have no state, only to make it: local, and the parameters are put
        back as they were.  (Horovod's leaves that step's change: weight decay -- AdamW,
        ASGD, Muon -- moves those ranks' parameters after ``broadcast_parameters``, and
        the ranks train apart by it.)"""
        params = [p for g in self.param_groups for p in g["params"]]
        kept = [p.detach().clone() for p in params]
        try:
            return self._base_step(closure)
        finally:
            for p, k in zip(params, kept):
                p.copy_(k)

    def step(self, closure=None):
        if called_by_broadcast_optimizer_state():  # state init: no exchange, as Horovod's
            return self._state_init_step(closure)
        if self._local_phase():
            return self._local.step(closure)
        if self._dga is not None and self._communicates():
            return self._dga.step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        self._optimizer_steps += 1
        return self._base_step(closure)

    def average_parameters(self):
        """Local SGD: average parameters and float buffers now (``step()`` does every
        ``backward_passes_per_step`` local steps), e.g. before evaluating."""
        if self._local is None:
            raise RuntimeError("average_parameters() is for local_sgd=True")
        self._local.average()

    def drain(self):
        """DGA: wait for the collectives still in flight (their averages are not applied);
        call before tearing Horovod down or saving a checkpoint."""
        if self._dga is not None:
            self._dga.drain()

    def zero_grad(self, set_to_none=True):
        if self._pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        sd["hvd_compress"] = {"compressor": self._compression.state_dict(),
                              "spec": self._compression.describe(),
                              "optimizer_steps": self._optimizer_steps}
        if self._local is not None:
            sd["hvd_compress"].update(self._local.state_dict())
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop("hvd_compress", None)
        self._pending.clear()
        self._ready.clear()
        self._synchronized = False
        self._should_synchronize = True
        self._reset_passes()
        super(self.__class__, self).load_state_dict(state_dict)
        if ours is not None:
            comp = self._compression
            single = getattr(comp, "policy", None) and comp.policy.single
            if single is not None and ours["spec"] == str(single):
                # a checkpoint of 0.1 (one compressor, no policy): its state is that spec's
                comp.child(single).load_state_dict(ours["compressor"])
            elif ours["spec"] != comp.describe():
                raise ValueError(f"checkpoint was made with compression {ours['spec']!r}, "
                                 f"this optimizer uses {comp.describe()!r}")
            else:
                comp.load_state_dict(ours["compressor"])
            self._step_unsure = True
            self._optimizer_steps = ours.get("optimizer_steps", 0)
            if self._local is not None:
                self._local.load_state_dict(ours)

    @property
    def compression(self):
        return self._compression


def _check_args(specs, op, gradient_predivide_factor, backward_passes_per_step, local_sgd,
                local_sgd_warmup_steps, delay, start_step):
    """The wrapper's argument checks over ``specs`` (those known when it is made; a
    per-tensor policy's chosen ones again once the parameters are named)."""
    check_wrapper_args("hvd_compress.torch.DistributedOptimizer",
                       "horovod.torch.DistributedOptimizer", op == hvd.Average, op == hvd.Adasum,
                       gradient_predivide_factor, backward_passes_per_step, local_sgd,
                       local_sgd_warmup_steps, delay, specs,
                       op_sums=op in (hvd.Average, hvd.Sum), start_step=start_step)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set, *,
                         local_sgd=False, local_sgd_warmup_steps=0, named_buffers=None, delay=0,
                         min_numel=DEFAULT_MIN_NUMEL, start_step=0, hierarchical=None):
    """Wrap ``optimizer`` so gradients are compressed, exchanged and averaged across ranks.

    Arguments are those of ``horovod.torch.DistributedOptimizer`` 0.28.1, with
    ``compression`` also taking any hvd_compress compressor or a spec string
    (``"topk:ratio=0.01"``), or a per-tensor choice (:mod:`hvd_compress.core.policy`):
    an ordered mapping from parameter-name patterns to specs (first match wins;
    ``"pattern=spec;..."`` as text) or a callable ``(name, shape, dtype) -> spec``.
    ``min_numel`` (default 1,024): tensors with fewer elements travel uncompressed,
    all in one allreduce per step (``0``: off).
    ``start_step=N``: the first N steps send every gradient uncompressed.
    ``optimizer.plan()`` / ``print_plan()`` show each tensor's compressor and bytes.
    The returned object is an instance of the wrapped
    optimizer's class; ``optimizer.comm_stats`` accumulates the current step's
    bytes and times, ``optimizer.last_stats`` holds the last synchronized step's,
    and ``optimizer.comm_totals`` the sums since creation.

    Beyond Horovod (see :mod:`hvd_compress.localsteps`):

    * ``local_sgd=True``: real local SGD.  Each backward pass is followed by
      this worker's own ``step()``, and every ``backward_passes_per_step``
      steps the workers average their parameters (compressed: their change
      since the last average, with error feedback) and the floating-point
      buffers in ``named_buffers`` (pass ``model.named_buffers()`` for
      BatchNorm statistics).  The wrapped optimizer's state stays local.
      ``local_sgd_warmup_steps=K`` runs K ordinary synchronous steps first
      (post-local SGD).  Without ``local_sgd``, ``backward_passes_per_step`` is
      Horovod's gradient accumulation: no worker steps on its own.
    * ``delay=D``: Delayed Gradient Averaging.  Step i's gradients are sent
      without waiting; their average is applied at step i + D through the
      correction ``g_i - g_{i-D} + avg(g_{i-D})``.  ``D=0`` is synchronous.
      Needs a one-round compressor (not PowerSGD) and
      ``backward_passes_per_step=1``; call ``optimizer.drain()`` at the end.
    * ``hierarchical``: compressed gradients summed dense inside each node, compressed
      only between nodes (:mod:`hvd_compress.core.hierarchy`).  ``None`` (default): on
      wherever the node process sets are registered (``hvd.init(process_sets=
      hvd_compress.nodes.node_process_sets())``, or :func:`hvd_compress.nodes.
      add_node_process_sets`) and the optimizer uses the global process set; ``True``:
      required (an error otherwise); ``False``: off.
    """
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    comp = as_compression(compression, min_numel, start_step)
    _check_args(comp.specs(), op, gradient_predivide_factor, backward_passes_per_step,
                local_sgd, local_sgd_warmup_steps, delay, start_step)
    if not local_sgd and not isinstance(comp, TorchPolicy):  # (a policy pairs once named)
        pair_dgc_with_momentum(optimizer, comp)  # local steps keep their own momentum
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, comp, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, local_sgd,
               local_sgd_warmup_steps, named_buffers, delay, hierarchical)
