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
from collections import deque
from contextlib import contextmanager

import horovod.torch as hvd
import torch
from horovod.common.util import split_list

from ..frontend import new_stats
from ..localsteps import LocalSGDSchedule, check_local_args
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
                 sparse_as_dense=False, process_set=hvd.global_process_set, local_sgd=False,
                 local_sgd_warmup_steps=0, named_buffers=None, delay=0):
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
        # Local SGD: backward_passes_per_step is the averaging period, each pass a local step.
        self._local = LocalSGDSchedule(backward_passes_per_step, local_sgd_warmup_steps) \
            if local_sgd else None
        self._buffers = [(k, b) for k, b in (named_buffers or ()) if b.is_floating_point()]
        self._anchors = None        # parameters after the last average (compressed local SGD)
        self._delay = delay
        self._inflight = deque()    # DGA: (pending collectives, local gradients) per step
        self._snapshots = {}        # DGA: this step's local gradients, kept for the correction
        self._tag = ""              # DGA: collective names differ between steps in flight
        self._optimizer_steps = 0
        self._allreduce_delay = {v: self._passes() for _, v in named_parameters}
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

    def _passes(self):
        """Backward passes summed before an exchange (one per local step in local SGD)."""
        return 1 if self._local is not None else self.backward_passes_per_step

    def _local_phase(self):
        return self._local is not None and not self._local.synchronous(self._optimizer_steps)

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
            self._local = LocalSGDSchedule(passes, self._local.warmup)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self._passes()

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

    def _launch(self, group, src=None):
        """Encode and send ``group``'s gradients (or the tensors ``src`` maps them to)."""
        comp = self._compression.core
        if self._plain and len(group) == 1 and src is None and not self._delay:
            return self._launch_plain(group)
        t0 = time.perf_counter()
        encs = []
        for p in group:
            grad = self._grad(p) if src is None else src[p]
            if self._delay:  # DGA: the local gradient is needed D steps later, unchanged
                grad = self._snapshots[p] = grad.detach().clone()
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
        name = f"hvd_compress.{self._parameter_names[group[0]]}.{rnd}{self._tag}"
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
        self._launch_missing()
        self._collect(self._pending)
        self._pending.clear()
        self._ready.clear()
        self._reset_passes()
        self._steps_synchronized += 1
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
        """Finish the collectives in ``pending`` (group -> _Pending) and leave each
        parameter's average in ``p.grad`` (or in ``dest[p]``)."""
        comp = self._compression.core

        # Extra rounds (PowerSGD): finish round r for every group, then start r + 1.
        def more(pd):
            return pd.encs is not None and comp.rounds(pd.encs[0].meta) - 1 > pd.round

        while any(more(pd) for pd in pending.values()):
            for group, pd in list(pending.items()):
                if more(pd):
                    reduced = self._wait(pd)
                    t0 = time.perf_counter()
                    encs = [comp.next_round(e, r) for e, r in zip(pd.encs, reduced)]
                    self.comm_stats["encode_ms"] += (time.perf_counter() - t0) * 1e3
                    self._start(group, encs)
                    pending[group] = self._pending.pop(group)
        size = self.process_set.size()
        for group, pd in pending.items():
            if pd.encs is None:  # plain in-place allreduce: p.grad already holds the result
                t0 = time.perf_counter()
                hvd.synchronize(pd.handle)
                self.comm_stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
                continue
            received = self._wait(pd)
            t0 = time.perf_counter()
            for p, enc, got in zip(group, pd.encs, received):
                target = p.grad if dest is None else dest[p]
                if pd.summable and self._compression.spec.name == "none":
                    result = got.reshape(p.shape)  # Horovod already averaged and scaled
                else:  # decoded straight into the target where it can be (no dense temporary)
                    into = target if target is not None and not target.is_sparse \
                        and target.dtype == p.dtype and target.shape == p.shape else None
                    result = comp.aggregate(got, enc, out=into)
                    if self.op == hvd.Average:
                        scale = self.gradient_predivide_factor / size
                        result = result.mul_(scale) if result is into else result * scale
                if result is not target:
                    if dest is None:
                        self._set_grad(p, result)
                    else:
                        target.copy_(result)
            self.comm_stats["decode_ms"] += (time.perf_counter() - t0) * 1e3

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
        if self._local_phase():
            return self._local_step(closure)
        if self._delay and self.process_set.included() and self.process_set.size() > 1:
            return self._delayed_step(closure)
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
        return super(self.__class__, self).step(closure)

    # -- local SGD -----------------------------------------------------------------------------
    def _local_step(self, closure):
        """A worker's own step; after every ``period``-th one, the workers average."""
        if not self._plain:
            self._ensure_anchors()  # before the first local step: where every rank stands
        loss = super(self.__class__, self).step(closure)
        step = self._optimizer_steps
        self._optimizer_steps += 1
        if self._local.averages_after(step) and self.process_set.included() \
                and self.process_set.size() > 1:
            self.average_parameters()
        self._close_step()
        return loss

    def average_parameters(self):
        """Average the parameters (and floating-point buffers) over the ranks now.

        Uncompressed: the parameters themselves are allreduced (their exact mean).
        Compressed: each rank sends its change since the last average through the
        compressor (with its error feedback), and all ranks add the decoded mean
        change to the same starting point.  Called by ``step()`` every
        ``backward_passes_per_step`` local steps."""
        params = self._requires_update
        if self._plain:
            self._allreduce_in_place([(self._parameter_names[p], p.data) for p in params])
        else:
            self._ensure_anchors()
            deltas = {p: p.detach() - self._anchors[p] for p in params}
            for group in self._groups:
                self._launch(group, src=deltas)
            self._collect(self._pending, dest=deltas)
            self._pending.clear()
            with torch.no_grad():
                for p in params:
                    self._anchors[p].add_(deltas[p])
                    p.copy_(self._anchors[p])
        self._allreduce_in_place(self._buffers)

    def _ensure_anchors(self):
        """The parameters after the last average (compressed local SGD), made once."""
        if self._anchors is None:
            self._anchors = {p: p.detach().clone() for p in self._requires_update}

    def _allreduce_in_place(self, named):
        t0 = time.perf_counter()
        handles = [hvd.allreduce_async_(t, name=f"hvd_compress.local.{name}", op=hvd.Average,
                                        process_set=self.process_set) for name, t in named]
        for _, t in named:
            self.comm_stats["bytes_sent"] += t.numel() * t.element_size()
            self.comm_stats["collectives"] += 1
        for h in handles:
            hvd.synchronize(h)
        self.comm_stats["comm_ms"] += (time.perf_counter() - t0) * 1e3

    # -- Delayed Gradient Averaging ------------------------------------------------------------
    def _delayed_step(self, closure):
        """Send this step's gradients, apply the average that arrived from ``delay`` steps
        ago through DGA's correction, and step."""
        self._launch_missing()
        self._inflight.append((dict(self._pending), dict(self._snapshots)))
        self._pending.clear()
        self._ready.clear()
        self._snapshots = {}
        self._reset_passes()
        if len(self._inflight) > self._delay:
            pending, stale = self._inflight.popleft()
            with torch.no_grad():
                for p, g_old in stale.items():  # g_i - g_{i-D} ...
                    self._grad(p).sub_(g_old)
                self._collect(pending, dest=stale)  # avg(g_{i-D}) into the old buffers
                for p, avg_old in stale.items():  # ... + avg(g_{i-D})
                    p.grad.add_(avg_old)
        self._optimizer_steps += 1
        self._tag = f".d{self._optimizer_steps % (self._delay + 1)}"
        self._steps_synchronized += 1
        self._close_step()
        return super(self.__class__, self).step(closure)

    def drain(self):
        """Wait for DGA's collectives still in flight (their averages are not applied):
        call before tearing Horovod down or saving a checkpoint."""
        while self._inflight:
            pending, stale = self._inflight.popleft()
            self._collect(pending, dest=stale)
        self._close_step()

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
                              "spec": str(self._compression.spec),
                              "optimizer_steps": self._optimizer_steps}
        if self._anchors is not None:
            sd["hvd_compress"]["anchors"] = {self._parameter_names[p]: a.clone()
                                             for p, a in self._anchors.items()}
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
            if ours["spec"] != str(self._compression.spec):
                raise ValueError(f"checkpoint was made with compression {ours['spec']!r}, "
                                 f"this optimizer uses {str(self._compression.spec)!r}")
            self._compression.load_state_dict(ours["compressor"])
            self._optimizer_steps = ours.get("optimizer_steps", 0)
            if "anchors" in ours:
                by_name = {n: p for p, n in self._parameter_names.items()}
                self._anchors = {by_name[n]: a.clone() for n, a in ours["anchors"].items()}

    @property
    def compression(self):
        return self._compression


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set, *,
                         local_sgd=False, local_sgd_warmup_steps=0, named_buffers=None, delay=0):
    """Wrap ``optimizer`` so gradients are compressed, exchanged and averaged across ranks.

    Arguments are those of ``horovod.torch.DistributedOptimizer`` 0.28.1, with
    ``compression`` also taking any hvd_compress compressor or a spec string
    (``"topk:ratio=0.01"``).  The returned object is an instance of the wrapped
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
    check_local_args(local_sgd, backward_passes_per_step, local_sgd_warmup_steps, delay,
                     op == hvd.Average, comp.spec)
    if not local_sgd:  # local steps keep their own momentum; DGC then compresses changes
        _pair_dgc_with_momentum(optimizer, comp)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, comp, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, local_sgd,
               local_sgd_warmup_steps, named_buffers, delay)


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
