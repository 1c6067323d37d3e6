"""The PyTorch optimizer shell: the class :func:`~.distributed.DistributedOptimizer` makes.

It hands the wrapped optimizer's gradients to a :class:`~hvd_compress.session.Session`
(which groups them, agrees on the plan and the steps, and runs the exchange engine)
through a :class:`~.grads.GradientPath` (hooks, what a parameter sends, where its
average lands), and keeps Horovod's optimizer API: ``synchronize()`` /
``skip_synchronize()``, ``set_backward_passes_per_step``, ``state_dict()``.  Local SGD
(DiLoCo's outer step included) and DGA are strategies in :mod:`.localsteps`.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import horovod.torch as hvd
import torch

from ..pertensor import format_plan
from ..session import Session, fuse_uncompressed
from .adam import ShellExchange
from .agreement import entries, optimizer_plan
from .checkpoint import load_ours, ours
from .collectives import HorovodTorch
from .compressors import TorchPolicy, settle_policy
from .elastic import elastic_launch, sync_compressor_state
from .grads import GradientPath
from .localsteps import DelayedAveraging, LocalSGD
from .params import (
    SYNCHRONIZED_TWICE,
    ZERO_GRAD_IN_FLIGHT,
    called_by_broadcast_optimizer_state,
    check_args,
    checked_names,
    make_groups,
    state_init_step,
)
from .sparse import SparseAware


class _DistributedOptimizer(torch.optim.Optimizer):
    """See the module docstring; instances are of a class made from this one's dict."""
    _hvd_compress = True  # (the classes made from this one's dict: see .elastic)

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=hvd.Average, gradient_predivide_factor=1.0, groups=None,
                 sparse_as_dense=False, process_set=hvd.global_process_set, local_sgd=False,
                 local_sgd_warmup_steps=0, named_buffers=None, delay=0, hierarchical=None,
                 exchange="auto", **outer):
        super(self.__class__, self).__init__(params)
        s = self._session = Session(
            hvd, process_set, HorovodTorch, op=op, predivide=gradient_predivide_factor,
            hierarchical=hierarchical, exchange=exchange, local_sgd=local_sgd,
            period=backward_passes_per_step,
            warmup=local_sgd_warmup_steps, delay=delay, on_world=self._on_world)
        self._compression = compression
        named_parameters = checked_names(self.param_groups, named_parameters)
        names = self._parameter_names = {v: k for k, v in sorted(named_parameters,
                                                                 key=lambda kv: kv[0])}
        self.backward_passes_per_step, self.op, self.process_set = backward_passes_per_step, op, process_set
        self.gradient_predivide_factor, self.sparse_as_dense = gradient_predivide_factor, sparse_as_dense
        self._synchronized, self._should_synchronize = False, True
        # Empty parameters carry nothing to exchange.
        self._requires_update = [p for g in self.param_groups for p in g["params"]
                                 if p.requires_grad and p.numel() > 0]
        self._path = GradientPath(s, names, compression, sparse_as_dense)
        made = make_groups(self._requires_update, names, groups)
        if isinstance(compression, TorchPolicy):
            check_args(settle_policy(self, compression, entries(self._requires_update, names),
                                      local_sgd), op, gradient_predivide_factor,
                        backward_passes_per_step, local_sgd, local_sgd_warmup_steps, delay,
                        compression.policy.start_step)
            if groups is None:  # (one allreduce for the uncompressed, once all ready)
                made = fuse_uncompressed(
                    made, lambda p: not compression.compresses(*entries([p], names)[0]))
        # Local SGD: backward_passes_per_step is the averaging period, each pass a local step.
        s.set_groups(made, 1 if local_sgd else backward_passes_per_step)
        self._local = LocalSGD(s, self._requires_update, names, compression, named_buffers,
                               self._base_step, self._path.exchange_all, **outer) \
            if local_sgd else None  # (outer: DiLoCo's outer_lr, outer_momentum, fragments)
        self._dga = DelayedAveraging(s, delay, self._path, self._base_step) if delay else None
        self._rule = ShellExchange.of(self, compression)  # 1-bit / 0-1 Adam: no hooks
        if s.follow_world(compression) and elastic_launch():
            self._path.register_hooks(self._requires_update)  # (as Horovod's: it may grow)
        s.attach(compression, self._plan, wrap=lambda e: SparseAware(e, process_set, op),
                 on_first=lambda: sync_compressor_state(  # (see .elastic)
                     self, root_rank=min(process_set.ranks or [0])))

    hierarchical = property(lambda self: self._session.hierarchical, doc="""Whether compressed
        gradients cross nodes hierarchically (:mod:`hvd_compress.core.hierarchy`).""")

    def _on_world(self, size, reset):
        """Bound to a world of ``size`` ranks (the session calls it): hooks from two on."""
        if size > 1:
            self._path.register_hooks(self._requires_update)
        if reset:
            self._synchronized = False

    # -- the per-tensor plan ---------------------------------------------------------------
    def plan(self) -> list:
        """Per parameter, in exchange order: name, shape, dtype, the compressor it travels
        with (once compression has started) and its payload bytes per step."""
        return self._session.with_exchanges(self._compression.plan(entries(
            [p for g in self._session.groups for p in g], self._parameter_names)))

    def print_plan(self, file=None) -> str:
        """Print (and return) :meth:`plan` as a table."""
        policy = getattr(self._compression, "policy", None)
        text = format_plan(self.plan(), policy.start_step if policy is not None else 0)
        print(text, file=file, flush=True)
        return text

    def _plan(self):
        comp, local = self._compression, self._local
        return optimizer_plan(self._session, comp, self._parameter_names, self._session.groups,
                              self.plan() if hasattr(comp, "policy") else None,
                              self.backward_passes_per_step, self.sparse_as_dense, local)

    # -- steps -----------------------------------------------------------------------------
    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        self._session.set_period(passes)

    def synchronize(self):
        self._path.synchronize()
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
            return state_init_step(self.param_groups, getattr(self, "rule_init", self._base_step), closure)
        if self._rule is not None or s.local_phase():  # 1-bit / 0-1 Adam, local SGD
            return (self._rule or self._local).step(closure)
        if self._dga is not None and s.communicates():
            return self._dga.step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(SYNCHRONIZED_TWICE)
            self.synchronize()
        self._synchronized = False
        s.steps += 1
        return self._base_step(closure)

    def average_parameters(self):
        """Local SGD: average parameters and float buffers now (DiLoCo: an outer step of
        every fragment), e.g. before evaluating; ``step()`` does it when due."""
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
            raise AssertionError(ZERO_GRAD_IN_FLIGHT)
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # -- state -----------------------------------------------------------------------------
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
