"""PyTorch compressors: the core's algorithms on torch tensors, on Horovod's contract.

Each class runs :mod:`hvd_compress.core` through :class:`~.backend.TorchBackend`
and offers Horovod's ``compress(tensor) -> (tensor, ctx)`` /
``decompress(tensor, ctx) -> tensor``.  Pass one as ``compression=`` to
:func:`hvd_compress.torch.DistributedOptimizer` (every compressor), or to
Horovod's own ``hvd.DistributedOptimizer`` (those whose payload can be summed:
``none``, ``FP16``, ``BF16``, ``RandomK``, ``PowerSGD``); the others raise a
clear error there on first use.

Inside Horovod's optimizer ``compress()`` is given no tensor name; the name,
which keys per-tensor state and Random-k's shared indices, is read from
Horovod 0.28.1's ``_allreduce_grad_async(self, p)`` frame (its
``self._parameter_names[p]``), else the tensor's shape stands in.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch

from .. import spec as specmod
from ..core import registry
from ..core.base import warn_once
from ..frontend import CompressorFrontend, class_names, horovod_builtin_spec, named_class
from ..frontend import compressor as _compressor
from ..pertensor import PolicyFrontend, resolve
from .backend import TorchBackend

__all__ = ["TorchCompressor", "TorchPolicy", "compressor", "as_compressor", "as_compression",
           *class_names()]

BACKEND = TorchBackend()


class TorchCompressor(CompressorFrontend):
    """A compressor spec bound to the torch backend; one instance per optimizer."""

    BACKEND = BACKEND
    HOROVOD_WRAPPER = "horovod.torch.DistributedOptimizer"
    OUR_WRAPPER = "hvd_compress.torch.DistributedOptimizer"

    def __init__(self, spec):
        self._init_frontend(spec)

    # -- configuration -------------------------------------------------------------
    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.spec)!r})"

    def bind(self, rank: int, world_size: int) -> "TorchCompressor":
        """Set this rank and the number of ranks (done by the optimizer)."""
        if self._core is not None and (rank, world_size) != (self._rank, self._world_size):
            self._rank, self._world_size = rank, world_size
            self._rebuild()
        self._rank, self._world_size = rank, world_size
        return self

    def _rebuild(self) -> None:
        """Build the core again (other rank or parameters), keeping its per-tensor state
        and DGC's warm-up epoch (a ``set_epoch`` made before the first step)."""
        old = self._core
        self._core = None
        self.core.load_state_dict(old.state_dict())
        self._keep_epoch(old)

    def with_param(self, part: int, key: str, value) -> None:
        """Change one parameter of spec part ``part`` (keeps the state)."""
        parts = list(self.spec.parts)
        params = dict(parts[part].params)
        params[key] = value
        parts[part] = specmod.CompressorSpec(parts[part].name, params)
        self.spec = specmod.Spec(tuple(parts))
        if self._core is not None:
            self._rebuild()

    @property
    def core(self):
        if self._core is None:
            self._core = self._build_core()
        return self._core

    def _horovod_rank_size(self):
        return _horovod_rank_size()

    def state_dict(self) -> dict:
        """Per-tensor state as CPU tensors and plain Python values, so that ``torch.load``
        with its default ``weights_only=True`` reads a checkpoint holding it."""
        return _plain(self.core.state_dict(), to_torch=True)

    def load_state_dict(self, state: dict) -> None:
        self.core.load_state_dict(_plain(state, to_torch=False))

    def _horovod_collectives(self):
        import horovod.torch as hvd

        from .collectives import HorovodTorch
        return HorovodTorch(hvd.global_process_set)

    def _contract_name(self, tensor) -> str:
        return _horovod_param_name() or _shape_name(tensor)


class TorchPolicy(PolicyFrontend):
    """A per-tensor policy on torch tensors (:mod:`hvd_compress.pertensor`): what the
    optimizer's ``compression`` is unless one spec goes to every tensor from the start."""

    BACKEND = BACKEND

    def __init__(self, policy, given=None):
        self._init_policy(policy, given)

    def __repr__(self) -> str:
        return f"TorchPolicy({str(self.policy)!r})"

    def _make_child(self, spec):
        return compressor(spec)

    def _child_protocol(self, child):
        return child.core

    @property
    def core(self):
        """The exchange engine drives the policy itself (its :meth:`pick`)."""
        return self

    def state_dict(self) -> dict:
        return _plain(self.policy_state(), to_torch=True)

    def load_state_dict(self, state: dict) -> None:
        self.load_policy_state(_plain(state, to_torch=False))


def emptied_state(sd: dict) -> dict:
    """A compressor's (or per-tensor policy's) ``state_dict()`` without any tensor's state
    or the two-phase owner's: every residual zero again, the rest (spec, noise) kept."""
    if "compressors" in sd:
        return {**sd, "compressors": {k: emptied_state(v) for k, v in sd["compressors"].items()}}
    return {**{k: v for k, v in sd.items() if k != "owner"}, "tensors": {}}


def as_compression(compression, min_numel: int, start_step: int):
    """What a torch wrapper's ``compression=`` becomes: the compressor itself where one spec
    goes to every tensor from the first step (``min_numel=0``, ``start_step=0``), else a
    :class:`TorchPolicy`."""
    return resolve(compression, min_numel, start_step, TorchCompressor, TorchPolicy, compressor)


def _plain(obj, to_torch: bool):
    """``obj`` with numpy arrays as CPU tensors (``to_torch``) or tensors as numpy arrays,
    and numpy scalars as Python ones, through dicts, lists and tuples."""
    if isinstance(obj, dict):
        return {k: _plain(v, to_torch) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v, to_torch) for v in obj)
    if to_torch and isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj, copy=True))
    if not to_torch and isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _horovod_rank_size():
    try:
        import horovod.torch as hvd
        if hvd.is_initialized():
            return hvd.rank(), hvd.size()
    except ImportError:  # pragma: no cover - Horovod is part of the set-up
        pass
    return 0, 1


def _horovod_param_name():
    """The parameter name from Horovod 0.28.1's ``_allreduce_grad_async(self, p)`` /
    ``_grouped_allreduce_grad_async(self, ps)`` frames, if we are called from there."""
    frame = sys._getframe(2)
    p = None
    for _ in range(4):
        if frame is None:
            return None
        local = frame.f_locals
        if p is None and isinstance(local.get("p"), torch.Tensor):
            p = local["p"]
        owner = local.get("self")
        names = getattr(owner, "_parameter_names", None)
        if p is not None and isinstance(names, dict) and p in names:
            return names[p]
        frame = frame.f_back
    return None


def _shape_name(tensor) -> str:
    warn_once("noname", "hvd_compress: compress() was called without a tensor name; per-tensor "
               "state and shared indices are keyed by shape (use "
               "hvd_compress.torch.DistributedOptimizer for names)")
    return "shape" + "x".join(str(d) for d in tensor.shape)


def __getattr__(name):
    """The named classes (``TopK``, ``QSGD``, ..., ``Compose``), made from the registry."""
    return named_class(TorchCompressor, name)


def compressor(spec) -> TorchCompressor:
    """A compressor from a spec string, e.g. ``compressor("topk:ratio=0.01")``."""
    return _compressor(TorchCompressor, spec)


def as_compressor(compression) -> TorchCompressor:
    """Accept our compressors, spec strings, None, and Horovod's ``Compression.none/fp16``."""
    if compression is None:
        return compressor("none")
    if isinstance(compression, TorchCompressor):
        return compression
    if isinstance(compression, str):
        return compressor(compression)
    return compressor(horovod_builtin_spec(compression))


def _owns_momentum(spec) -> bool:
    return bool(registry.core_of(spec).owns_momentum)


def settle_policy(optimizer, policy, entries, local_sgd: bool) -> list:
    """A per-tensor ``policy`` once the parameters are named (``entries``: ``(name,
    shape, dtype)``): DGC's tensors take the wrapped optimizer's momentum (not under
    local SGD, whose local steps keep their own), each tensor's compressor is fixed;
    returns the specs chosen, for the argument checks."""
    if not local_sgd:
        pair_dgc_with_momentum(optimizer, policy, entries)
    policy.settle(entries)
    return [policy.policy.spec_for(*e) for e in entries]


def pair_dgc_with_momentum(optimizer, comp, entries=()):
    """DGC applies momentum itself (momentum correction; its class ``owns_momentum``):
    move the wrapped optimizer's momentum into it, so that it is not applied twice (a
    policy: over ``entries``)."""
    if isinstance(comp, TorchPolicy):
        return _pair_policy(optimizer, comp, entries)
    if not _owns_momentum(comp.spec):
        return
    found = _optimizer_momentum(optimizer)
    if found is None:
        return
    m, nesterov = found
    comp.with_param(0, "momentum", m)
    if nesterov:
        comp.with_param(0, "nesterov", True)
    _take_momentum(optimizer, m)


def _optimizer_momentum(optimizer):
    """``(momentum, nesterov)`` of the wrapped optimizer, None without momentum."""
    moms = {g.get("momentum", 0.0) for g in optimizer.param_groups} - {0, 0.0}
    if not moms:
        return None
    if len(moms) > 1:
        raise ValueError(f"DGC applies momentum in the compressor, for all parameters alike; the "
                         f"wrapped optimizer has several momentum values {sorted(moms)}")
    return float(moms.pop()), any(g.get("nesterov", False) for g in optimizer.param_groups)


def _take_momentum(optimizer, m: float) -> None:
    """The wrapped optimizer's momentum to 0 (DGC applies it), with a warning."""
    for g in optimizer.param_groups:
        g["momentum"] = 0.0
        if "nesterov" in g:
            g["nesterov"] = False
    warnings.warn(f"DGC applies momentum {m} itself (momentum correction); the wrapped "
                  "optimizer's momentum was set to 0 so that it is not applied twice")


def _pair_policy(optimizer, comp: TorchPolicy, entries):
    """:func:`pair_dgc_with_momentum` for a policy over ``entries`` (``(name, shape,
    dtype)``): every DGC spec it chooses takes the optimizer's momentum (the policy's
    uncompressed tensors then carry it too)."""
    from ..core import policy as policymod
    chosen = [comp.policy.spec_for(*e) for e in entries] + comp.policy.known_specs()
    if not any(_owns_momentum(s) for s in chosen):
        return
    found = _optimizer_momentum(optimizer)
    if found is None:
        return
    m, nesterov = found

    def give(spec):
        if not _owns_momentum(spec):
            return spec
        part = spec.parts[0]
        first = specmod.CompressorSpec(part.name, registry.core_of(spec).with_momentum(
            part.params, m, nesterov))
        return specmod.Spec((first, *spec.parts[1:]))

    comp.policy = policymod.rewrite(comp.policy, give)
    comp.reset_plan()
    if comp._given is not None and _owns_momentum(comp._given.spec):
        comp._given.with_param(0, "momentum", m)
        if nesterov:
            comp._given.with_param(0, "nesterov", True)
    _take_momentum(optimizer, m)
