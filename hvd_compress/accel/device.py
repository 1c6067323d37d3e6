"""The device fast paths: Triton kernels behind the torch backend's ``fused_encoder``,
``fused_decoder`` and ``fused_unpack`` hooks for CUDA tensors, registered against the
algorithm's class, as the host paths are (:mod:`.host`).

Where they run: CUDA tensors, triton importable, ``HVD_COMPRESS_FUSED`` and
``HVD_COMPRESS_TRITON`` not ``0``; and, for the tests, CPU tensors when Triton's
interpreter is on (``TRITON_INTERPRET=1`` before triton is imported).  Anywhere else
each hook answers None and today's torch chain runs, with no warning (one warning where
triton imports but its kernels fail on a device, tried once per device).  Importing this
module imports neither torch nor triton: the kernels' wrappers
(:mod:`.triton_quantizers`) are imported on the first question about an eligible
tensor; that module's ``ENCODERS`` and ``DECODERS`` tables, keyed by the
algorithm's class, say what each algorithm has.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

from .registry import requested

__all__ = ["enabled", "every_kernel", "interpreting", "available", "device_encoder", "device_decoder",
           "device_unpack", "device_top_indices", "device_powersgd"]

_KERNELS = None  # .triton_quantizers once imported, False where triton is missing


#: the radix select from this many values on (top-k of 25.6M values at 1%: 4.59 ms
#: against the chain's ``kth_largest`` and compaction, 2.30 ms; smaller arrays -- DGC's
#: sample and candidates -- keep it, as measured there)
SELECT_CHAIN_FROM = 1 << 24


def enabled() -> bool:
    """``HVD_COMPRESS_FUSED=0`` turns every fast path off, ``HVD_COMPRESS_TRITON=0`` the
    Triton kernels alone (``all``: also those measured slower than their chains)."""
    return requested() and os.environ.get("HVD_COMPRESS_TRITON", "1") != "0"


def every_kernel() -> bool:
    """``HVD_COMPRESS_TRITON=all``: the kernels measured slower than their chains run too
    (to time or test them)."""
    return os.environ.get("HVD_COMPRESS_TRITON", "1") == "all"


def _held_back(like) -> bool:
    """Whether the kernels measured slower than their chains stay off for ``like`` (a
    tensor): on CUDA devices, unless ``HVD_COMPRESS_TRITON=all``."""
    return getattr(getattr(like, "device", None), "type", None) == "cuda" and not every_kernel()


def interpreting() -> bool:
    """Whether Triton's interpreter is asked for (``TRITON_INTERPRET=1``): kernels then run
    on CPU tensors, in numpy (the tests' way without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available():
    """The kernels' wrappers (:mod:`.triton_quantizers`, triton imported there, once), or
    False where triton is not installed or does not import."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = False
        if importlib.util.find_spec("triton") is not None:
            try:
                from . import triton_quantizers
                _KERNELS = triton_quantizers
            except Exception:  # a broken triton install: today's path, silently
                _KERNELS = False
    return _KERNELS


_WORKS: dict = {}  # device -> whether a first small kernel ran there and gave its values


def _works(k, device) -> bool:
    """Whether the kernels run on ``device``: tried once per device and process with a small
    decode (a GPU Triton cannot compile for, or a broken toolchain, shows here rather than
    in a training step); where not, one warning and today's path from then on."""
    key = str(device)
    if key not in _WORKS:
        try:
            _WORKS[key] = bool(k.probe(device))
            why = "it decoded other values than the chain"
        except Exception as exc:  # noqa: BLE001 - whatever stops them, the chain runs
            _WORKS[key], why = False, f"{type(exc).__name__}: {exc}"
        if not _WORKS[key]:
            warnings.warn(f"hvd_compress: the Triton kernels do not run on {key} ({why}); "
                          "using the torch operations there (HVD_COMPRESS_TRITON=0 skips "
                          "trying)", RuntimeWarning, stacklevel=3)
    return _WORKS[key]


def _kernels(like):
    """The wrappers' module where ``like`` (a tensor) is one the kernels run on, else None."""
    device = getattr(like, "device", None)
    kind = getattr(device, "type", None)
    if kind != "cuda" and not (kind == "cpu" and interpreting()):
        return None
    if not enabled():
        return None
    k = available()
    return k if k and _works(k, device) else None


def device_encoder(B, obj, cols: int, like):
    """The fused encoder for ``obj`` (a codec) on ``like``'s device, or None: the contract
    of ``NumpyBackend.fused_encoder``, ``finite`` a 0-d tensor."""
    k = _kernels(like)
    slow = k is not None and _held_back(like) and k.SLOWER_ON_CUDA.find(obj) is not None
    make = None if k is None or slow else k.ENCODERS.find(obj)
    return None if make is None else make(B, obj, cols)


def device_decoder(B, obj, cols: int, like):
    """The fused decoder for ``obj`` on ``like``'s device -- ``(fields, n) -> float32[n]``,
    the chain's bits -- or None."""
    k = _kernels(like)
    slow = k is not None and _held_back(like) and k.SLOWER_ON_CUDA.find(obj) is not None
    make = None if k is None or slow else k.DECODERS.find(obj)
    return None if make is None else make(B, obj, cols)


def device_unpack(B, data, bits: int, n: int, values, factors=None, d=None, cols: int = 1):
    """:func:`~hvd_compress.core.bitpack.unpack_values` as one kernel (codes of 1, 2, 4 or 8
    bits, one column), or None."""
    if cols != 1 or bits not in (1, 2, 4, 8):
        return None
    k = _kernels(data)
    return None if k is None else k.unpack(B, data, bits, n, values, factors, d)


def device_top_indices(B, mag, k: int):
    """:func:`~hvd_compress.core.sparsifiers.topk_indices` as a radix select and one
    compaction (the same indices), or None (also from :data:`SELECT_CHAIN_FROM` values on
    a CUDA device, where the chain was measured faster)."""
    kern = _kernels(mag)
    if kern is None or (_held_back(mag) and mag.numel() >= SELECT_CHAIN_FROM):
        return None
    return kern.top_indices(B, mag, k)


def device_powersgd(like):
    """PowerSGD's element-wise passes as Triton kernels for ``like``'s device
    (:mod:`.triton_powersgd`: ``finite_matrix``, ``keep_finite``), or None."""
    if _kernels(like) is None:
        return None
    from . import triton_powersgd
    return triton_powersgd
