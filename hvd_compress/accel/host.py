"""The host fast paths: numba kernels behind the core's ``fused_encoder`` and
``fused_decoder`` hooks, registered against the algorithm's class.

The core (:mod:`hvd_compress.core`) holds only the reference chains and never imports
this package or numba.  Importing :mod:`hvd_compress` installs :func:`host_encoder`
and :func:`host_decoder` in the core's provider slot
(:func:`hvd_compress.core.backend.set_host_fast_paths`); the numpy backend, and the
torch backend for CPU tensors, then answer the hooks from the :data:`PATHS` that the
accelerator modules (:mod:`.host_signs`, :mod:`.host_stochastic`, :mod:`.host_levels`,
:mod:`.host_select`) fill with :func:`register`.  numba is imported, and the kernels
loaded from its disk cache, on the first fast path asked for -- not with the package.

An encoder keeps the contract of ``NumpyBackend.fused_encoder`` with a Python bool for
``finite``: the step starts as the core's host path does
(:func:`~hvd_compress.core.base.ef_sum_host`: finiteness, ``residual += g`` in place,
overflow counted as non-finite and undone); on NaN/Inf it returns at once (no noise
drawn) and the core runs its reference non-finite step.  A decoder writes all of its
result, the chain's bits.  ``HVD_COMPRESS_FUSED=0`` turns every fast path off.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ..core.base import ef_sum_host
from ..core.bitpack import packed_nbytes
from .registry import ByClass, requested

__all__ = ["HostPath", "PATHS", "SMALLEST", "register", "unregister", "host_encoder",
           "host_decoder", "numba_available", "numba_kernels", "ef_encoder", "whole_step",
           "requested", "code_buffer"]


@dataclass(frozen=True)
class HostPath:
    """One algorithm's host fast paths (see :func:`register`)."""

    cls: type
    kernels: Callable[[], Any]
    encoder: Optional[Callable] = None
    decoder: Optional[Callable] = None
    decodes: Optional[Callable] = None


#: the registered fast paths, by the algorithm's class (codec or compressor)
PATHS = ByClass()
#: the fewest elements a registered class's encoder takes (smaller tensors: the chain)
SMALLEST: dict = {}


def register(cls, *, encoder=None, decoder=None, decodes=None, kernels=None, smallest=0):
    """Register host fast paths for the algorithm class ``cls`` (its subclasses too,
    unless they register their own; ``register(cls)`` alone gives none).

    ``encoder(k, B, obj, cols)``: the fused encoder for ``obj`` (an instance of ``cls``)
    on backend ``B`` -- for a codec ``(g, residual, noise, noise_source) -> (fields,
    residual, finite)``, see :func:`ef_encoder` and :func:`whole_step`; for a compressor
    the callable its ``_encode_fused`` asks for -- or None to decline.  ``decoder(k, B,
    obj, fields, out)``: write the decoded float32 values into ``out`` from the payload's
    fields (host arrays), or return False to decline that payload; ``decodes(obj, cols)``
    says whether it decodes at all (default: yes).  ``k`` is what ``kernels()`` returns
    (default :func:`numba_kernels`), loaded on the first fast path asked for; a falsy
    value means no fast path.  ``smallest``: tensors with fewer elements take the chain."""
    PATHS[cls] = HostPath(cls, kernels or numba_kernels, encoder, decoder, decodes)
    SMALLEST.pop(cls, None)
    if smallest:
        SMALLEST[cls] = int(smallest)


def unregister(cls) -> None:
    """Forget ``cls``'s fast paths (its objects take a base's, or the chain)."""
    PATHS.pop(cls, None)
    SMALLEST.pop(cls, None)


_KERNELS = None  # .kernels once loaded, False without numba


def numba_available() -> bool:
    """Whether numba is installed (found without importing it)."""
    return importlib.util.find_spec("numba") is not None


def numba_kernels():
    """The numba kernels (:mod:`.kernels`, numba imported on the first call), or False
    without numba."""
    global _KERNELS
    if _KERNELS is None:
        if numba_available():
            from . import kernels
            _KERNELS = kernels
        else:  # pragma: no cover - numba is installed by scripts/setup.sh
            _KERNELS = False
    return _KERNELS


def host_encoder(B, obj, cols: int):
    """The host backends' fused encoder for ``obj`` (a codec or a compressor), or None:
    turned off, numba missing, no fast path registered for its class, or declined."""
    path = PATHS.find(obj)
    if path is None or path.encoder is None or not requested():
        return None
    k = path.kernels()
    if not k:
        return None
    encode = path.encoder(k, B, obj, cols)
    smallest = SMALLEST.get(path.cls, 0)
    if encode is None or not smallest:
        return encode
    # declined for a small tensor (nothing touched): the chain
    return lambda g, *rest: None if B.shape(g)[0] < smallest else encode(g, *rest)


def host_decoder(B, obj, cols: int):
    """The host backends' fused decoder for ``obj`` -- ``(fields, n) -> float32[n]``, the
    chain's bits -- or None: turned off, numba missing, or none for its class."""
    path = PATHS.find(obj)
    if path is None or path.decoder is None or not requested() or \
            (path.decodes is not None and not path.decodes(obj, cols)):
        return None
    k = path.kernels()
    if not k:
        return None
    body = path.decoder

    def decode(fields, n):
        out = RESULTS.take(n)
        if body(k, B, obj, {key: B.host_view(a) for key, a in fields.items()}, out) is False:
            return None  # declined for this payload: the chain
        return B.from_host(out)
    return decode


# -- helpers of the accelerator modules ---------------------------------------------------
def ef_encoder(body):
    """An ``encoder`` for :func:`register` from ``body(k, B, codec, v, noise, ef) ->
    fields``: the core's host start (:func:`ef_sum_host`), the noise drawn where the
    codec needs it and none was given, then the body, which with ``ef`` leaves the new
    residual in ``v``."""
    def encoder(k, B, codec, cols):
        def encode(g, residual, noise, noise_source):
            v, finite = ef_sum_host(B, g, residual)
            if not finite:
                return None, residual, False
            if getattr(codec, "needs_noise", False) and noise is None:
                noise = noise_source.draw(B.shape(v)[0], like=g)
            fields = body(k, B, codec, v, noise, residual is not None)
            return fields, (v if residual is not None else None), True
        return encode
    return encoder


def whole_step(step):
    """An ``encoder`` for :func:`register` from a whole step ``step(k, B, obj, g, residual,
    noise, noise_source) -> (fields, residual, finite)`` (codecs whose first pass does
    more than the core's host start)."""
    def encoder(k, B, obj, cols):
        return lambda g, residual, noise, noise_source: step(k, B, obj, g, residual, noise,
                                                             noise_source)
    return encoder


def code_buffer(n, bits):
    """A fresh numpy buffer for ``n`` packed ``bits``-bit codes."""
    return np.empty(packed_nbytes(n, bits), np.uint8)


class _ResultBuffers:
    """Big decoded results (float32, 1 MiB and more) in buffers reused once nothing holds
    them -- no array, view or tensor over them (CPython's reference count says so) -- as
    the TensorFlow ops' buffer cache: a fresh 100 MB buffer is fresh pages, whose first
    touches cost about a copy and, where numpy has asked the kernel for huge pages, at
    times waited on its compaction (60-125 ms a decode seen here).  At most 1 GiB is
    kept (the oldest let go first).  Every decoder writes all of its result."""

    SMALLEST = 1 << 20
    HELD = 1 << 30

    def __init__(self):
        self._kept = []  # oldest first
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        if 4 * n < self.SMALLEST:
            return np.empty(n, np.float32)
        with self._lock:
            for a in self._kept:
                # held by the list, this loop and the call only: nobody else sees it
                if a.shape[0] == n and sys.getrefcount(a) == 3:
                    return a
            out = np.empty(n, np.float32)
            self._kept.append(out)
            while sum(a.nbytes for a in self._kept) > self.HELD:
                self._kept.pop(0)  # a holder keeps it alive; the list only lets go
            return out


RESULTS = _ResultBuffers()
