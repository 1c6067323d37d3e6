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

import torch

from .. import spec as specmod
from ..core.base import warn_once
from ..frontend import CompressorFrontend, horovod_builtin_spec
from .backend import TorchBackend

__all__ = ["TorchCompressor", "NoneCompressor", "FP16", "BF16", "TopK", "RandomK", "DGC", "QSGD",
           "TernGrad", "OneBit", "Threshold", "PowerSGD", "Compose", "compressor", "as_compressor"]

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
            state = self._core.state_dict()
            self._core = None
            self._rank, self._world_size = rank, world_size
            self.core.load_state_dict(state)
        self._rank, self._world_size = rank, world_size
        return self

    def with_param(self, part: int, key: str, value) -> None:
        """Change one parameter of spec part ``part`` (keeps the state)."""
        parts = list(self.spec.parts)
        params = dict(parts[part].params)
        params[key] = value
        parts[part] = specmod.CompressorSpec(parts[part].name, params)
        self.spec = specmod.Spec(tuple(parts))
        if self._core is not None:
            state = self._core.state_dict()
            self._core = None
            self.core.load_state_dict(state)

    @property
    def core(self):
        if self._core is None:
            self._core = self._build_core()
        return self._core

    def _horovod_rank_size(self):
        return _horovod_rank_size()

    def state_dict(self) -> dict:
        return self.core.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.core.load_state_dict(state)

    def _horovod_collectives(self):
        from .collectives import HorovodTorch
        return HorovodTorch()

    def _contract_name(self, tensor) -> str:
        return _horovod_param_name() or _shape_name(tensor)


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


def _spec_text(name: str, params: dict) -> str:
    given = [f"{k}={v}" for k, v in params.items() if v is not None]
    return name + (":" + ",".join(given) if given else "")


class NoneCompressor(TorchCompressor):
    """No compression (32 bits per element, allreduce)."""

    def __init__(self):
        super().__init__("none")


class FP16(TorchCompressor):
    """Cast to float16 for the allreduce (as Horovod's ``Compression.fp16``)."""

    def __init__(self):
        super().__init__("fp16")


class BF16(TorchCompressor):
    """Round to bfloat16; sent as float16 since Horovod cannot allreduce bfloat16."""

    def __init__(self):
        super().__init__("bf16")


class TopK(TorchCompressor):
    """Top-k sparsification with error feedback (Aji & Heafield 2017)."""

    def __init__(self, ratio=0.01, ef=None):
        super().__init__(_spec_text("topk", {"ratio": ratio, "ef": ef}))


class RandomK(TorchCompressor):
    """Random-k with indices shared by all ranks (Stich et al. 2018); allreduce."""

    def __init__(self, ratio=0.01, unbiased=None, ef=None, seed=None):
        super().__init__(_spec_text("randomk", {"ratio": ratio, "unbiased": unbiased, "ef": ef,
                                                "seed": seed}))


class DGC(TorchCompressor):
    """Deep Gradient Compression (Lin et al. 2018); pair with SGD without momentum."""

    def __init__(self, ratio=0.001, momentum=None, nesterov=None, sample_ratio=None,
                 warmup_epochs=None, steps_per_epoch=None, clip_norm=None, seed=None):
        super().__init__(_spec_text("dgc", dict(
            ratio=ratio, momentum=momentum, nesterov=nesterov, sample_ratio=sample_ratio,
            warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch, clip_norm=clip_norm,
            seed=seed)))


class QSGD(TorchCompressor):
    """QSGD stochastic quantization (Alistarh et al. 2017), unbiased."""

    def __init__(self, levels=7, bucket=None, ef=None, seed=None):
        super().__init__(_spec_text("qsgd", {"levels": levels, "bucket": bucket, "ef": ef,
                                             "seed": seed}))


class TernGrad(TorchCompressor):
    """TernGrad (Wen et al. 2017), unbiased ternary quantization."""

    def __init__(self, clip=None, ef=None, seed=None):
        super().__init__(_spec_text("terngrad", {"clip": clip, "ef": ef, "seed": seed}))


class OneBit(TorchCompressor):
    """1-bit SGD with error feedback (Seide et al. 2014)."""

    def __init__(self, ef=None):
        super().__init__(_spec_text("onebit", {"ef": ef}))


class Threshold(TorchCompressor):
    """2-bit threshold quantization with residual (Strom 2015)."""

    def __init__(self, tau=0.01, ef=None):
        super().__init__(_spec_text("threshold", {"tau": tau, "ef": ef}))


class PowerSGD(TorchCompressor):
    """PowerSGD low-rank compression (Vogels et al. 2019); two allreduce rounds."""

    def __init__(self, rank=2, ef=None, warm_start=None, seed=None):
        super().__init__(_spec_text("powersgd", {"rank": rank, "ef": ef, "warm_start": warm_start,
                                                 "seed": seed}))


class Compose(TorchCompressor):
    """A sparsifier then a quantizer of the kept values, e.g. ``Compose(TopK(0.01), QSGD(16))``."""

    def __init__(self, sparsifier: TorchCompressor, quantizer: TorchCompressor):
        super().__init__(f"{sparsifier.spec}+{quantizer.spec}")


_BY_NAME = {"none": NoneCompressor, "fp16": FP16, "bf16": BF16, "topk": TopK, "randomk": RandomK,
            "dgc": DGC, "qsgd": QSGD, "terngrad": TernGrad, "onebit": OneBit,
            "threshold": Threshold, "powersgd": PowerSGD}


def compressor(spec) -> TorchCompressor:
    """A compressor from a spec string, e.g. ``compressor("topk:ratio=0.01")``."""
    parsed = specmod.parse(spec)
    cls = Compose if parsed.composed else _BY_NAME[parsed.name]
    obj = cls.__new__(cls)
    TorchCompressor.__init__(obj, parsed)
    return obj


def as_compressor(compression) -> TorchCompressor:
    """Accept our compressors, spec strings, None, and Horovod's ``Compression.none/fp16``."""
    if compression is None:
        return NoneCompressor()
    if isinstance(compression, TorchCompressor):
        return compression
    if isinstance(compression, str):
        return compressor(compression)
    return compressor(horovod_builtin_spec(compression))


def pair_dgc_with_momentum(optimizer, comp):
    """DGC applies momentum itself (momentum correction): move the wrapped optimizer's
    momentum into it, so that it is not applied twice."""
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
