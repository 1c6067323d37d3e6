"""``hvd_compress.torch.DistributedOptimizer``: Horovod's optimizer, with every compressor.

A drop-in replacement for ``horovod.torch.DistributedOptimizer`` (0.28.1): the
same arguments, defaults and behaviour -- gradient hooks start communication
during the backward pass, ``synchronize()``/``skip_synchronize()``,
``backward_passes_per_step`` accumulation, ``op``, ``gradient_predivide_factor``,
``groups``/``num_groups``, ``sparse_as_dense``, ``process_set`` -- plus:

* the collective each compressor needs: ``allreduce`` for summable payloads
  (none, fp16, bf16, random-k, PowerSGD's two rounds) and ``allgather`` of the
  packed bytes for the rest, then aggregation after decoding;
* per-parameter compressor state keyed by parameter name, saved and restored
  with ``state_dict()``/``load_state_dict()`` together with the wrapped
  optimizer's state;
* an account of bytes sent and of encode/communicate/decode time per step
  (:attr:`comm_stats`).

Built on Horovod's public API only (``allreduce_async``, ``allgather_async``,
``synchronize``).  Communication starts in a post-accumulate-grad hook once a
parameter's gradient is complete for the step (after ``backward_passes_per_step``
backward passes); a group's collective starts when all of its parameters are
ready.  Payloads of a group are laid end to end in one collective.

**DGC and momentum.** DGC applies momentum inside the compressor (momentum
correction), so the wrapped optimizer must not apply it again: use
``torch.optim.SGD(momentum=0)`` and give the momentum to DGC
(``dgc:momentum=0.9``, the default).  If the wrapped optimizer has
``momentum=m > 0``, the optimizer moves it into DGC (DGC's momentum becomes
``m``, the optimizer's 0) and warns.
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager

import horovod.torch as hvd
import torch
from horovod.common.util import split_list

from ..frontend import new_stats
from .compressors import as_compressor, wire

__all__ = ["DistributedOptimizer"]


class _Pending:
    """One group's collective in flight."""

    __slots__ = ("group", "encs", "handle", "sizes", "shapes", "summable", "round")

    def __init__(self, group, encs, handle, sizes, shapes, summable, round_):
        self.group, self.encs, self.handle = group, encs, handle
        self.sizes, self.shapes, self.summable, self.round = sizes, shapes, summable, round_


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=hvd.Average, gradient_predivide_factor=1.0, groups=None,
                 sparse_as_dense=False, process_set=hvd.global_process_set):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        names = [k for k, _ in named_parameters]
        dups = {k for k in names if names.count(k) > 1}
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. "
                             f"Found duplicates: {', '.join(sorted(dups))}")
        all_ids = {id(v) for g in self.param_groups for v in g["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._pending = {}          # group -> _Pending
        self._ready = {}            # group -> parameters ready this step
        self._hooks = []
        self._synchronized = False
        self._should_synchronize = True
        # Empty parameters carry nothing to exchange.
        self._requires_update = [p for g in self.param_groups for p in g["params"]
                                 if p.requires_grad and p.numel() > 0]
        self._groups = self._split_by_rounds(self._make_groups(groups))
        self._p_to_group = {p: g for g in self._groups for p in g}
        self._plain = compression.spec.name == "none"
        self.comm_stats = new_stats()
        self.comm_totals = new_stats()
        self._steps_synchronized = 0
        if process_set.included():
            self._compression.bind(hvd.rank(), process_set.size())
            if process_set.size() > 1:
                self._register_hooks()

    # -- groups and hooks ------------------------------------------------------------------
    def _make_groups(self, groups):
        ordered = sorted(self._requires_update, key=lambda p: self._parameter_names[p])
        if groups is None:
            return [(p,) for p in ordered]
        if isinstance(groups, list):
            seen, out = set(), []
            for lst in groups:
                for p in lst:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
                members = tuple(p for p in ordered if any(p is q for q in lst))
                if members:
                    out.append(members)
            out += [(p,) for p in ordered if id(p) not in seen]
            return out
        if not groups > 0:
            raise ValueError("groups should be a non-negative integer or a list of list of "
                             "torch.Tensor.")
        return [tuple(g) for g in split_list(ordered, groups) if g]

    def _split_by_rounds(self, groups):
        """Members of one collective must need the same number of rounds (PowerSGD sends
        vectors dense in one round and matrices in two)."""
        core = self._compression.core
        out = []
        for group in groups:
            by_rounds = {}
            for p in group:
                by_rounds.setdefault(core.rounds(core.meta_for(p.detach(), "")), []).append(p)
            out += [tuple(members) for members in by_rounds.values()]
        return out

    def _register_hooks(self):
        for p in self._requires_update:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(param):
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
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    # -- communication -------------------------------------------------------------------------
    def _grad(self, p):
        if p.grad is None:
            # Another rank may have a gradient for it (dynamic graphs): take part with zeros.
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            if not self.sparse_as_dense:
                raise ValueError(f"parameter {self._parameter_names[p]!r} has a sparse gradient; "
                                 "compressed exchange needs sparse_as_dense=True")
            grad = grad.to_dense()
        return grad

    def _launch(self, group):
        comp = self._compression.core
        if self._plain and len(group) == 1:
            return self._launch_plain(group)
        t0 = time.perf_counter()
        encs = []
        for p in group:
            grad = self._grad(p)
            if self.op == hvd.Average and self.gradient_predivide_factor != 1.0:
                grad = grad * (1.0 / self.gradient_predivide_factor)
            encs.append(comp.encode(grad, self._parameter_names[p]))
        self.comm_stats["encode_ms"] += (time.perf_counter() - t0) * 1e3
        self._start(group, encs)

    def _launch_plain(self, group):
        """Uncompressed and ungrouped: exactly Horovod's in-place allreduce of ``p.grad``."""
        (p,) = group
        grad = self._grad(p)
        if grad is not p.grad:  # sparse_as_dense
            p.grad = grad
        pre, post = (1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor) \
            if self.op == hvd.Average else (1.0, 1.0)
        handle = hvd.allreduce_async_(p.grad, name=f"hvd_compress.{self._parameter_names[p]}.0",
                                      op=self.op, prescale_factor=pre, postscale_factor=post,
                                      process_set=self.process_set)
        self.comm_stats["bytes_sent"] += p.grad.numel() * p.grad.element_size()
        self.comm_stats["collectives"] += 1
        self._pending[group] = _Pending(group, None, handle, None, None, True, 0)

    def _start(self, group, encs):
        comp = self._compression.core
        summable = comp.summable
        payloads = [wire(e.payload) if summable else e.payload for e in encs]
        sizes = [int(x.numel()) for x in payloads]
        shapes = [tuple(x.shape) for x in payloads]
        flat = payloads[0].reshape(-1) if len(payloads) == 1 else \
            torch.cat([x.reshape(-1) for x in payloads])
        rnd = encs[0].round
        name = f"hvd_compress.{self._parameter_names[group[0]]}.{rnd}"
        self.comm_stats["bytes_sent"] += sum(e.nbytes for e in encs)
        self.comm_stats["collectives"] += 1
        if summable and self._compression.spec.name == "none":
            # Exactly what Horovod's own optimizer does for uncompressed gradients.
            pre, post = (1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor) \
                if self.op == hvd.Average else (1.0, 1.0)
            handle = hvd.allreduce_async(flat, name=name, op=self.op, prescale_factor=pre,
                                         postscale_factor=post, process_set=self.process_set)
        elif summable:
            handle = hvd.allreduce_async(flat, name=name, op=hvd.Sum, process_set=self.process_set)
        else:
            handle = hvd.allgather_async(flat, name=name, process_set=self.process_set)
        self._pending[group] = _Pending(group, encs, handle, sizes, shapes, summable, rnd)

    def _wait(self, pending):
        t0 = time.perf_counter()
        out = hvd.synchronize(pending.handle)
        self.comm_stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
        parts, offset = [], 0
        if pending.summable:
            for size, shape, enc in zip(pending.sizes, pending.shapes, pending.encs):
                parts.append(out[offset:offset + size].reshape(shape))
                offset += size
            return parts
        nranks = self.process_set.size()
        rows = out.reshape(nranks, -1)
        for size in pending.sizes:
            parts.append([rows[r, offset:offset + size] for r in range(nranks)])
            offset += size
        return parts

    def synchronize(self):
        if not self.process_set.included():
            self._synchronized = True
            return
        comp = self._compression.core
        for group in self._groups:  # parameters whose hook did not fire this step
            if group not in self._pending:
                self._launch(group)
        # Extra rounds (PowerSGD): finish round r for every group, then start r + 1.
        def more(pd):
            return pd.encs is not None and comp.rounds(pd.encs[0].meta) - 1 > pd.round

        while any(more(pd) for pd in self._pending.values()):
            for group, pd in list(self._pending.items()):
                if more(pd):
                    reduced = self._wait(pd)
                    t0 = time.perf_counter()
                    encs = [comp.next_round(e, r) for e, r in zip(pd.encs, reduced)]
                    self.comm_stats["encode_ms"] += (time.perf_counter() - t0) * 1e3
                    self._start(group, encs)
        size = self.process_set.size()
        for group in self._groups:
            pd = self._pending[group]
            if pd.encs is None:  # plain in-place allreduce: p.grad already holds the result
                t0 = time.perf_counter()
                hvd.synchronize(pd.handle)
                self.comm_stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
                self._allreduce_delay[group[0]] = self.backward_passes_per_step
                continue
            received = self._wait(pd)
            t0 = time.perf_counter()
            for p, enc, got in zip(group, pd.encs, received):
                if pd.summable and self._compression.spec.name == "none":
                    result = got.reshape(p.shape)  # Horovod already averaged and scaled
                else:  # decoded straight into p.grad where it can be (no dense temporary)
                    grad = p.grad
                    into = grad if grad is not None and not grad.is_sparse and grad.dtype == p.dtype \
                        and grad.shape == p.shape else None
                    result = comp.aggregate(got, enc, out=into)
                    if self.op == hvd.Average:
                        scale = self.gradient_predivide_factor / size
                        result = result.mul_(scale) if result is into else result * scale
                if result is not p.grad:
                    self._set_grad(p, result)
                self._allreduce_delay[p] = self.backward_passes_per_step
            self.comm_stats["decode_ms"] += (time.perf_counter() - t0) * 1e3
        self._pending.clear()
        self._ready.clear()
        self._steps_synchronized += 1
        self.last_stats = dict(self.comm_stats)
        for key, value in self.comm_stats.items():
            self.comm_totals[key] += value
        self.comm_stats = new_stats()
        self._synchronized = True

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

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

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
                              "spec": str(self._compression.spec)}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop("hvd_compress", None)
        self._pending.clear()
        self._ready.clear()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(state_dict)
        if ours is not None:
            if ours["spec"] != str(self._compression.spec):
                raise ValueError(f"checkpoint was made with compression {ours['spec']!r}, "
                                 f"this optimizer uses {str(self._compression.spec)!r}")
            self._compression.load_state_dict(ours["compressor"])

    @property
    def compression(self):
        return self._compression


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set):
    """Wrap ``optimizer`` so gradients are compressed, exchanged and averaged across ranks.

    Arguments are those of ``horovod.torch.DistributedOptimizer`` 0.28.1, with
    ``compression`` also taking any hvd_compress compressor or a spec string
    (``"topk:ratio=0.01"``).  The returned object is an instance of the wrapped
    optimizer's class; ``optimizer.comm_stats`` accumulates the current step's
    bytes and times, ``optimizer.last_stats`` holds the last synchronized step's,
    and ``optimizer.comm_totals`` the sums since creation.
    """
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == hvd.Adasum:
        raise ValueError("hvd_compress.torch.DistributedOptimizer does not support op=Adasum; "
                         "use horovod.torch.DistributedOptimizer for Adasum")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    comp = as_compressor(compression)
    _pair_dgc_with_momentum(optimizer, comp)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, comp, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)


def _pair_dgc_with_momentum(optimizer, comp):
    if comp.spec.parts[0].name != "dgc":
        return
    moms = {g.get("momentum", 0.0) for g in optimizer.param_groups}
    moms.discard(0.0)
    moms.discard(0)
    if not moms:
        return
    if len(moms) > 1:
        raise ValueError(f"DGC applies momentum in the compressor, for all parameters alike; the "
                         f"wrapped optimizer has several momentum values {sorted(moms)}")
    m = moms.pop()
    comp.with_param(0, "momentum", float(m))
    nesterov = any(g.get("nesterov", False) for g in optimizer.param_groups)
    if nesterov:
        comp.with_param(0, "nesterov", True)
    for g in optimizer.param_groups:
        g["momentum"] = 0.0
        if "nesterov" in g:
            g["nesterov"] = False
    warnings.warn(f"DGC applies momentum {m} itself (momentum correction); the wrapped "
                  "optimizer's momentum was set to 0 so that it is not applied twice")
