"""``hvd_compress.torch.DistributedOptimizer``: Horovod's optimizer, with every compressor.

A drop-in replacement for ``horovod.torch.DistributedOptimizer`` (0.28.1): the same
arguments, defaults and behaviour (gradient hooks start communication during the
backward pass, ``synchronize()``/``skip_synchronize()``, ``backward_passes_per_step``,
``op``, ``gradient_predivide_factor``, ``groups``, ``sparse_as_dense``,
``process_set``).  It is a shell around a :class:`~hvd_compress.session.Session`,
which groups the gradients, agrees on the plan and the steps, and runs the exchange
engine; local SGD and DGA are strategies in :mod:`.localsteps`.

**DGC and momentum.** DGC applies momentum inside the compressor (momentum
correction), so the wrapped optimizer must not apply it again: use
``torch.optim.SGD(momentum=0)`` and give the momentum to DGC (``dgc:momentum=0.9``,
the default).  A wrapped optimizer's ``momentum=m > 0`` is moved into DGC (warning).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import horovod.torch as hvd
import torch

from ..core.policy import DEFAULT_MIN_NUMEL
from ..localsteps import check_horovod_args
from ..pertensor import format_plan
from ..session import Session, fuse_uncompressed
from .agreement import optimizer_plan
from .checkpoint import load_ours, ours
from .collectives import HorovodTorch
from .compressors import TorchPolicy, as_compression, pair_dgc_with_momentum
from .elastic import elastic_launch, sync_compressor_state
from .grads import collect, gradient
from .localsteps import DelayedAveraging, LocalSGD
from .params import (
    called_by_broadcast_optimizer_state,
    checked_names,
    make_groups,
    state_init_step,
)
from .sparse import SparseAware

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(torch.optim.Optimizer):
    _hvd_compress = True  # (the classes made from this one's dict: see .elastic)

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=hvd.Average, gradient_predivide_factor=1.0, groups=None,
                 sparse_as_dense=False, process_set=hvd.global_process_set, local_sgd=False,
                 local_sgd_warmup_steps=0, named_buffers=None, delay=0, hierarchical=None):
        super(self.__class__, self).__init__(params)
        self._hooks = []
        s = self._session = Session(
            hvd, process_set, HorovodTorch, op=op, predivide=gradient_predivide_factor,
            hierarchical=hierarchical, local_sgd=local_sgd, period=backward_passes_per_step,
            warmup=local_sgd_warmup_steps, delay=delay, on_world=self._on_world)
        self._compression = compression
        named_parameters = checked_names(self.param_groups, named_parameters)
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step, self.op, self.process_set = backward_passes_per_step, \
            op, process_set
        self.gradient_predivide_factor, self.sparse_as_dense = gradient_predivide_factor, \
            sparse_as_dense
        self._synchronized, self._should_synchronize = False, True
        # Empty parameters carry nothing to exchange.
        self._requires_update = [p for g in self.param_groups for p in g["params"]
                                 if p.requires_grad and p.numel() > 0]
        policy = isinstance(compression, TorchPolicy)
        if policy:
            entries = self._entries(self._requires_update)
            if not local_sgd:  # (local steps keep their own momentum)
                pair_dgc_with_momentum(self, compression, entries)
            compression.settle(entries)
            _check_args([compression.policy.spec_for(*e) for e in entries], op,
                        gradient_predivide_factor, backward_passes_per_step, local_sgd,
                        local_sgd_warmup_steps, delay, compression.policy.start_step)
        made = make_groups(self._requires_update, self._parameter_names, groups)
        if policy and groups is None:  # (one allreduce for the uncompressed, once all ready)
            made = fuse_uncompressed(
                made, lambda p: not compression.compresses(*self._entries([p])[0]))
        # Local SGD: backward_passes_per_step is the averaging period, each pass a local step.
        s.set_groups(made, 1 if local_sgd else backward_passes_per_step)
        self._local = LocalSGD(s, self._requires_update, self._parameter_names, compression,
                               named_buffers, self._base_step, self._exchange_all
                               ) if local_sgd else None
        self._dga = DelayedAveraging(s, delay, self._launch, self._grad, self._collect,
                                     self._base_step) if delay else None
        if s.follow_world(compression) and elastic_launch() and not self._hooks:
            self._register_hooks()  # (as Horovod's: the world may grow)
        #: whether compressed gradients go by the hierarchical exchange (dense inside a
        #: node, compressed between nodes: :mod:`hvd_compress.core.hierarchy`)
        self.hierarchical = s.hierarchical
        s.attach(compression, self._plan, wrap=lambda e: SparseAware(e, process_set, op),
                 on_first=lambda: sync_compressor_state(  # (see .elastic)
                     self, root_rank=min(process_set.ranks or [0])))

    def _on_world(self, size, reset):
        """Bound to a world of ``size`` ranks (the session calls it): hooks from two on."""
        if size > 1 and not self._hooks:
            self._register_hooks()
        if reset:
            self._synchronized = False

    # -- the per-tensor plan ---------------------------------------------------------------
    def _entries(self, params):
        return [(self._parameter_names[p], tuple(p.shape), str(p.dtype).replace("torch.", ""))
                for p in params]

    def plan(self) -> list:
        """Per parameter, in exchange order: name, shape, dtype, the compressor it travels
        with (once compression has started) and its payload bytes per step."""
        return self._compression.plan(self._entries([p for g in self._session.groups
                                                     for p in g]))

    def print_plan(self, file=None) -> str:
        """Print (and return) :meth:`plan` as a table."""
        start = getattr(self._compression, "policy", None)
        text = format_plan(self.plan(), start.start_step if start is not None else 0)
        print(text, file=file, flush=True)
        return text

    def _plan(self):
        comp, local = self._compression, self._local
        return optimizer_plan(self._session, comp, self._parameter_names, self._session.groups,
                              self.plan() if hasattr(comp, "policy") else None,
                              self.backward_passes_per_step, self.sparse_as_dense,
                              local.buffers if local is not None else [])

    # -- hooks and communication ----------------------------------------------------------
    def _register_hooks(self):
        for p in self._requires_update:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(param):
            if self._session.local_phase():
                return
            group = self._session.ready(p)
            if group is not None:
                self._launch(group)
        return hook

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        s = self._session
        if s.schedule is not None:
            s.schedule.period = int(passes)
        s.set_passes(1 if s.schedule is not None else passes)

    def _grad(self, p):
        return gradient(p, self._parameter_names[p], self._compression, self.sparse_as_dense)

    def _launch(self, group, src=None):
        """Encode and send ``group``'s gradients (or the tensors ``src`` maps them to)."""
        dga = self._dga
        grads = [self._grad(p) if src is None else src[p] for p in group]
        if dga is not None and src is None:
            grads = dga.keep(group, grads)
        self._session.send(group, grads, [self._parameter_names[p] for p in group],
                           dga.tag if dga is not None else "")

    def _exchange_all(self, src):
        """Send every group's tensors in ``src`` and leave their averages there."""
        s, pending = self._session, {}
        for group in s.groups:
            self._launch(group, src=src)
            pending[group] = s.pending.pop(group)
        self._collect(pending, dest=src)

    def _collect(self, pending, dest=None):
        collect(self._session.engine, pending, self._session.stats, dest)

    def synchronize(self):
        if self._session.exchanges():
            self._session.synchronize(self._launch, self._collect)
        self._synchronized = True

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

    def step(self, closure=None):
        s = self._session
        if called_by_broadcast_optimizer_state():  # state init: no exchange, as Horovod's
            return state_init_step(self.param_groups, self._base_step, closure)
        if s.local_phase():
            return self._local.step(closure)
        if self._dga is not None and s.communicates():
            return self._dga.step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_SYNCHRONIZED_TWICE)
            self.synchronize()
        self._synchronized = False
        s.steps += 1
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
        if self._session.pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        sd["hvd_compress"] = ours(self._compression, self._session, self._local)
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop("hvd_compress", None)
        self._session.clear_pending()
        self._session.reset_passes()
        self._synchronized, self._should_synchronize = False, True
        super(self.__class__, self).load_state_dict(state_dict)
        if saved is not None:
            load_ours(saved, self._compression, self._session, self._local)

    compression = property(lambda self: self._compression)
    #: the :class:`~hvd_compress.session.Session` behind this optimizer
    hvd_compress_session = property(lambda self: self._session)
    #: this step's account so far (:class:`~hvd_compress.core.stats.Stats`)
    comm_stats = property(lambda self: self._session.stats)
    #: the last synchronized step's account
    last_stats = property(lambda self: self._session.last)
    #: the sums since the optimizer was made
    comm_totals = property(lambda self: self._session.totals)
    _optimizer_steps = property(lambda self: self._session.steps)


_SYNCHRONIZED_TWICE = ("optimizer.step() called without optimizer.skip_synchronize() context "
                       "after optimizer.synchronize(). This can cause training slowdown. You may "
                       "want to consider using optimizer.skip_synchronize() context if you use "
                       "optimizer.synchronize() in your code.")


def _check_args(specs, op, gradient_predivide_factor, backward_passes_per_step, local_sgd,
                local_sgd_warmup_steps, delay, start_step):
    """The wrapper's argument checks over ``specs`` (those known when it is made; a
    per-tensor policy's chosen ones again once the parameters are named)."""
    check_horovod_args(hvd, "hvd_compress.torch.DistributedOptimizer",
                       "horovod.torch.DistributedOptimizer", op, gradient_predivide_factor,
                       backward_passes_per_step, local_sgd, local_sgd_warmup_steps, delay, specs,
                       start_step)


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
    ``min_numel`` (default 1,024): smaller tensors travel uncompressed, all in one
    allreduce per step (``0``: off).  ``start_step=N``: the first N steps send every
    gradient uncompressed.  ``plan()`` / ``print_plan()`` show each tensor's compressor
    and bytes.  The result is an instance of the wrapped optimizer's class;
    ``comm_stats`` accumulates the current step's bytes and times, ``last_stats`` holds
    the last synchronized step's, ``comm_totals`` the sums since creation.

    Beyond Horovod (see :mod:`hvd_compress.localsteps`): ``local_sgd=True``: each
    backward pass is followed by this worker's own ``step()``, and every
    ``backward_passes_per_step`` steps the workers average their parameters
    (compressed: their change since the last average, with error feedback) and the
    float buffers in ``named_buffers`` (``model.named_buffers()`` for BatchNorm);
    ``local_sgd_warmup_steps=K`` synchronous steps come first.  ``delay=D``: Delayed
    Gradient Averaging, step i's average applied at step i + D as ``g_i - g_{i-D} +
    avg(g_{i-D})`` (a one-round compressor, ``backward_passes_per_step=1``; call
    ``drain()`` at the end).  ``hierarchical``: dense inside each node, compressed only
    between nodes (:mod:`hvd_compress.core.hierarchy`); ``None``: wherever the node
    process sets are registered (:func:`hvd_compress.nodes.node_process_sets`) and the
    global process set is used; ``True``: required; ``False``: off.
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
