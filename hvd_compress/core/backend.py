"""The small array backend every algorithm in :mod:`hvd_compress.core` is written against.

The algorithms never call numpy, torch or tensorflow directly: they call the
methods below on a backend object ``B``.  :class:`NumpyBackend` is the
reference; ``hvd_compress.torch`` and ``hvd_compress.tensorflow`` supply the
same methods on their own tensors, so one algorithm runs everywhere and gives
the same bits for the same input and noise.

Rules the algorithms keep, so that the framework backends stay fast on GPUs:

* no Python ``if``/loop on array *values* (that would copy to the host and
  synchronise the device): data-dependent choices go through :meth:`where`
  on 0-d arrays;
* every shape depends only on the input's shape and the compressor's
  parameters, never on the data (payload sizes are static);
* integer arithmetic that must wrap (hashing) is done in int64 and masked to
  32 bits, which every framework computes identically.

Dtype names are strings: ``"float16" "bfloat16" "float32" "float64" "uint8"
"int32" "int64"``.
"""

from __future__ import annotations

import os

import numpy as np

from .layout import OUT_FIRST, check_layout

__all__ = ["NumpyBackend", "NUMPY", "set_host_fast_paths", "host_fast_paths", "host_fast_decoders",
           "host_chunk_paths", "fill_uniform"]

_NP_DTYPES = {
    "float16": np.float16, "float32": np.float32, "float64": np.float64,
    "uint8": np.uint8, "int16": np.int16, "int32": np.int32, "int64": np.int64, "uint16": np.uint16,
    "bool": np.bool_,
}


class NumpyBackend:
    """Reference backend on numpy arrays (CPU).  ``layout``: the storage layout whose
    matrix view the algorithms take (:mod:`.layout`): PyTorch's by default, TensorFlow's
    (``"out_last"``) to compute what the TensorFlow backend must match."""

    name = "numpy"

    def __init__(self, layout: str = OUT_FIRST):
        self.layout = check_layout(layout)

    # -- dtypes and construction -------------------------------------------
    def dtype_name(self, x) -> str:
        return np.asarray(x).dtype.name

    def shape(self, x) -> tuple:
        return tuple(np.shape(x))

    def asarray(self, x, dtype: str | None = None, like=None):
        return np.asarray(x, dtype=_NP_DTYPES[dtype] if dtype else None)

    def cast(self, x, dtype: str):
        """``x`` as ``dtype`` (bool to uint8 is a view: 0/1 bytes, no copy)."""
        x = np.asarray(x)
        if dtype == "uint8" and x.dtype == np.bool_:
            return x.view(np.uint8)
        return x.astype(_NP_DTYPES[dtype], copy=False)

    def zeros(self, shape, dtype: str = "float32", like=None):
        return np.zeros(shape, dtype=_NP_DTYPES[dtype])

    def full(self, shape, value, dtype: str = "float32", like=None):
        return np.full(shape, value, dtype=_NP_DTYPES[dtype])

    def arange(self, n: int, dtype: str = "int64", like=None):
        return np.arange(n, dtype=_NP_DTYPES[dtype])

    def scalar(self, value, dtype: str = "float32", like=None):
        """A 0-d array (stays on the device in the framework backends)."""
        return np.asarray(value, dtype=_NP_DTYPES[dtype])

    def copy(self, x):
        return np.array(x, copy=True)

    # -- shape ----------------------------------------------------------------
    def reshape(self, x, shape):
        return np.reshape(x, shape)

    def concat(self, xs):
        return np.concatenate([np.ravel(x) for x in xs])

    def pad_to(self, x, n: int):
        """Flat ``x`` zero-padded at the end to length ``n`` (``n >= len(x)``)."""
        return np.pad(x, (0, n - x.shape[0]))

    # -- elementwise ----------------------------------------------------------
    def abs(self, x):
        return np.abs(x)

    def sign(self, x):
        return np.sign(x)

    def where(self, cond, a, b):
        return np.where(cond, a, b)

    def cond(self, pred, if_true, if_false):
        """``if_true()`` where the 0-d ``pred`` holds, else ``if_false()``: a branch where
        reading ``pred`` is free (host memory; only one side is computed), an
        element-wise select of both sides on a device."""
        return if_true() if bool(pred) else if_false()

    def isfinite(self, x):
        return np.isfinite(x)

    def floor(self, x):
        return np.floor(x)

    def log(self, x):
        return np.log(x)

    def cos(self, x):
        return np.cos(x)

    def sqrt(self, x):
        return np.sqrt(x)

    def maximum(self, a, b):
        return np.maximum(a, b)

    def minimum(self, a, b):
        return np.minimum(a, b)

    def clip(self, x, lo, hi):
        return np.clip(x, lo, hi)

    # -- reductions -------------------------------------------------------------
    def sum(self, x, axis=None):
        return np.sum(x, axis=axis)

    def max(self, x, axis=None):
        return np.max(x, axis=axis)

    def all_finite(self, x):
        """Whether every element is finite (NaN and +-Inf propagate through min and max)."""
        if x.size == 0:
            return np.bool_(True)
        return np.isfinite(np.min(x)) & np.isfinite(np.max(x))

    def absmax(self, x):
        """max |x| from the minimum and the maximum (no temporary)."""
        return np.maximum(np.abs(np.min(x)), np.abs(np.max(x)))

    def sum64(self, x, axis=None):
        """Sum with float64 accumulation; a float64 result (numpy's pairwise summation)."""
        return np.sum(x, axis=axis, dtype=np.float64)

    def sumsq64(self, x, axis=None):
        """Sum of squares of float32 ``x`` accumulated in float64 (float64 result)."""
        if x.ndim == 2 and axis == 1:
            return np.einsum("ij,ij->i", x, x, dtype=np.float64)
        if x.ndim == 1 and axis is None:
            return np.einsum("i,i->", x, x, dtype=np.float64)
        return np.sum(np.square(x, dtype=np.float64), axis=axis)

    def bucket_sumsq64(self, x, d: int):
        """Per bucket of ``d`` consecutive elements of flat ``x`` (the last may be shorter):
        the sum of squares accumulated in float64."""
        n = x.shape[0]
        full = n // d
        parts = [self.sumsq64(x[:full * d].reshape(full, d), axis=1)] if full else []
        if n % d:
            parts.append(np.reshape(self.sumsq64(x[full * d:]), (1,)))
        return np.concatenate(parts)

    def bucket_scale(self, x, factors, d: int):
        """Multiply each bucket of ``d`` elements of flat ``x`` by its factor; ``x`` is a
        fresh array the caller gives up (scaled in place); returns the result."""
        n = x.shape[0]
        full = n // d
        if full:
            x[:full * d].reshape(full, d)[...] *= factors[:full, None]
        if n % d:
            x[full * d:] *= factors[full]
        return x

    def count_nonzero(self, mask, axis=None):
        return np.asarray(np.count_nonzero(mask, axis=axis), dtype=np.int64)

    def cumsum(self, x):
        return np.cumsum(x)

    def kth_largest(self, x, k: int):
        """The k-th largest value of flat ``x`` (1-based), as a 0-d array."""
        n = x.shape[0]
        return np.partition(x, n - k)[n - k]

    def top_indices(self, mag, k: int):
        """The core's top-k selection (:func:`~hvd_compress.core.sparsifiers.topk_indices`)
        done faster by the backend itself, or None: then the core's generic selection
        runs (here always; the TF backend has a host-only shortcut)."""
        return None

    def fused_encoder(self, codec, cols: int, like=None):
        """A quantizer codec's whole encoding step as one fast path, or None: then the core's
        chain of array operations runs.  ``like`` is the tensor to be encoded (its device).

        The one hook for fast paths; the core calls it in one place
        (``QuantizerCompressor._encode_fused``).  It returns a callable
        ``(g, residual, noise, noise_source) -> (fields, new_residual, finite)``: ``g``
        the flat float32 gradient, ``residual`` the error-feedback state (None without),
        ``noise`` explicit uniform noise or None (then draw from ``noise_source``, the
        compressor's :class:`~hvd_compress.core.quantizers.NoiseSource`, if at all);
        ``fields`` the codec's payload fields, ``new_residual`` ``residual + g -
        decoded`` (may be ``residual`` itself, updated in place; ignored without error
        feedback).  ``finite``:

        * a 0-d array (device): the core multiplies the float fields by 1 or NaN
          and keeps the old residual where it is false;
        * a Python bool (host): True -- the fields are a finite step's and
          ``new_residual`` is the state; False -- NaN or Inf in ``g`` or in the
          float32 sum ``residual + g`` (overflow counts as non-finite): the fields
          are ignored, ``residual`` must be left as the core's host path leaves it
          (:func:`~hvd_compress.core.base.ef_sum_host`: untouched, or the sum undone
          by ``-= g``), no noise drawn, and the core runs its reference
          non-finite step.

        A provider may decline (None) for any codec or ``cols``.  Here: the host
        provider set by :func:`set_host_fast_paths` (``hvd_compress.accel`` sets
        its compiled kernels when ``hvd_compress`` is imported; the core never imports
        it), or None."""
        provider = _HOST_FAST_PATHS
        return None if provider is None else provider(self, codec, cols)

    def fused_decoder(self, codec, cols: int, like=None):
        """A quantizer codec's whole decoding as one fast path, or None: then the codec's
        chain (``decode_values``) runs.  The callable takes ``(fields, n)`` -- the
        payload's fields as :func:`~hvd_compress.core.bitpack.split_segments` gives them
        -- and returns the ``n`` decoded float32 values, the chain's bits.  The core
        asks in one place (``QuantizerCompressor._decode``); here the host decoder
        provider of :func:`set_host_fast_paths`, or None."""
        provider = _HOST_FAST_DECODERS
        return None if provider is None else provider(self, codec, cols)

    def chunk_path(self, comp, like=None):
        """The two-phase exchange's chunks of ``comp`` all in one call each
        (:mod:`hvd_compress.accel.host_chunks`), or None: one codec call a chunk.  Host
        memory only; the provider of :func:`set_host_fast_paths` (``chunks=``)."""
        provider = _HOST_CHUNK_PATHS
        return None if provider is None else provider(self, comp)

    def fused_unpack(self, data, bits: int, n: int, values, factors=None, d=None, cols: int = 1):
        """:func:`~hvd_compress.core.bitpack.unpack_values` as one backend op, or None (here
        always: the chain's table look-up); with ``cols`` > 1, ``values`` has a value per
        code and column (code-major)."""
        return None

    # -- indexing -----------------------------------------------------------------
    def gather(self, x, idx):
        return x[idx]

    def lookup(self, table, idx):
        """``table[idx]`` for small integer ``idx`` (uint8 codes or int64): rows of a table."""
        return table[idx]

    def bucketize(self, x, edges):
        """For each element of ``x``, how many of the sorted ``edges`` are ``<= x`` (int64):
        the index of its interval ``edges[i-1] <= x < edges[i]``."""
        return np.searchsorted(edges, x, side="right").astype(np.int64)

    def nonzero(self, mask):
        """Positions of the True entries (int64, increasing): a size known only once the
        values are (threshold-v; host sparsifiers' candidates)."""
        return np.flatnonzero(mask).astype(np.int64)

    def sort(self, x):
        return np.sort(x)

    def is_host(self, x) -> bool:
        """True when ``x`` lives in host memory, where reading a value costs no device
        synchronisation: algorithms may then branch on values and update state in place."""
        return True

    def flat_view(self, x):
        """A 1-d view sharing ``x``'s memory (writes show in ``x``), or None."""
        return x.reshape(-1) if x.flags.c_contiguous and x.flags.writeable else None

    def izero(self, x):
        """``x[...] = 0`` in place; returns ``x``."""
        x.fill(0)
        return x

    def icopy(self, x, y):
        """``x[...] = y`` in place; returns ``x``."""
        np.copyto(x, y)
        return x

    def iadd(self, x, y):
        """``x += y`` in place; returns ``x``."""
        np.add(x, y, out=x)
        return x

    def isign(self, x):
        """``sign(x)`` in place; returns ``x``."""
        np.sign(x, out=x)
        return x

    def imul(self, x, y):
        """``x *= y`` in place; returns ``x``."""
        np.multiply(x, y, out=x)
        return x

    def div(self, a, b):
        """Correctly rounded ``a / b`` (either may be a Python number)."""
        return np.true_divide(a, b)

    def idiv(self, x, y):
        """``x /= y`` in place; returns ``x``."""
        np.divide(x, y, out=x)
        return x

    def ifloor(self, x):
        """``x = floor(x)`` in place; returns ``x``."""
        np.floor(x, out=x)
        return x

    def iminimum(self, x, hi):
        """``x = minimum(x, hi)`` in place; returns ``x``."""
        np.minimum(x, hi, out=x)
        return x

    def ishr(self, x, s: int):
        """``x >>= s`` in place; returns ``x``."""
        np.right_shift(x, s, out=x)
        return x

    def iand(self, x, y):
        """``x &= y`` in place; returns ``x``."""
        np.bitwise_and(x, y, out=x)
        return x

    def isub(self, x, y):
        """``x -= y`` in place; returns ``x``."""
        np.subtract(x, y, out=x)
        return x

    def scatter_add(self, n: int, idx, values, dtype: str = "float32"):
        """Dense length-``n`` vector with ``values`` added at ``idx`` (duplicates add)."""
        if dtype == "float64":  # bincount adds in index order in float64, as add.at would
            return np.bincount(idx, weights=np.asarray(values, np.float64), minlength=n)
        out = np.zeros(n, dtype=_NP_DTYPES[dtype])
        np.add.at(out, idx, values)
        return out

    def index_add(self, acc, idx, values):
        """``acc[idx] += values`` in place, in index order (duplicates add); returns ``acc``."""
        np.add.at(acc, idx, values)
        return acc

    def iscale_at(self, x, idx, factor: float):
        """``x[i] *= factor`` in place, once for each distinct ``i`` of ``idx`` (repeats
        allowed: every copy writes the same product, as :meth:`imul` computes it)."""
        x[idx] = np.multiply(x[idx], factor)
        return x

    def compact(self, mask, k: int):
        """Indices of the first ``k`` True entries of flat ``mask``, in index order, padded
        with ``len(mask)`` (an out-of-range marker) when fewer are True; int64, length ``k``."""
        idx = np.flatnonzero(mask)[:k].astype(np.int64)
        return np.pad(idx, (0, k - idx.shape[0]), constant_values=mask.shape[0])

    # -- integers and bits ----------------------------------------------------------
    def shift_left(self, x, s):
        return np.left_shift(x, s)

    def shift_right(self, x, s):
        return np.right_shift(x, s)

    def bit_and(self, x, y):
        return np.bitwise_and(x, y)

    def bit_or(self, x, y):
        return np.bitwise_or(x, y)

    def bit_xor(self, x, y):
        return np.bitwise_xor(x, y)

    def mul_low32(self, x, c: int):
        """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` and a constant ``c < 2**32``."""
        prod = np.asarray(x).astype(np.uint64) * np.uint64(c)  # < 2**64: exact
        return (prod & np.uint64(0xFFFFFFFF)).astype(np.int64)

    def bitcast(self, x, dtype: str):
        """Reinterpret the bytes of flat contiguous ``x`` as ``dtype``."""
        return np.ascontiguousarray(x).view(_NP_DTYPES[dtype])

    def to_bfloat16_bits(self, x):
        """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return np.where(np.isnan(x), 0x7FC0, rounded).astype(np.uint16)

    def from_bfloat16_bits(self, bits):
        """bfloat16 bit patterns (uint16) -> float32; float16 (a sum that travelled as
        float16, see ``Compressor.wire``) -> float32."""
        bits = np.asarray(bits)
        if bits.dtype == np.float16:
            return bits.astype(np.float32)
        return (bits.astype(np.uint32) << 16).view(np.float32)

    # -- linear algebra -------------------------------------------------------------
    def matmul(self, a, b, transpose_a=False, transpose_b=False):
        """``a @ b``, with ``a`` (``a^T b``) or ``b`` (``a b^T``) transposed first; a
        backend may multiply by the transpose without making it."""
        a = self.transpose(a) if transpose_a else a
        b = self.transpose(b) if transpose_b else b
        return a @ b

    def subtract_product(self, c, a, b):
        """``c - a b^T`` (PowerSGD's residual: a matrix less a low-rank product of thin
        ``a`` and ``b``); a backend may do it in one pass without making ``a b^T``."""
        return c - self.matmul(a, b, transpose_b=True)

    def transpose(self, x):
        return np.ascontiguousarray(x.T)

    def orthonormalize(self, p):
        """Columns of ``p`` made orthonormal (Gram-Schmidt order, as PowerSGD does)."""
        q, r = np.linalg.qr(p)
        # Fix signs so the result does not depend on the QR routine's convention.
        d = np.sign(np.diagonal(r))
        d = np.where(d == 0, 1, d).astype(p.dtype)
        return q * d

    # -- random numbers (generators the compressor owns) --------------------------------
    def generator(self, seed: int):
        return np.random.Generator(np.random.PCG64(seed))

    def uniform(self, gen, n: int, like=None):
        return fill_uniform(gen, np.empty(n, np.float32))

    def random_key(self, gen, like=None) -> int:
        """A uniform 64-bit integer from ``gen`` (a fast path's noise key)."""
        return int(gen.integers(0, (1 << 64) - 1, dtype=np.uint64, endpoint=True))

    def generator_state(self, gen):
        return gen.bit_generator.state

    def set_generator_state(self, gen, state):
        gen.bit_generator.state = state

    # -- host conversion (tests, checkpoints; never in a hot path) -------------------------
    def to_numpy(self, x):
        return np.asarray(x)

    def from_numpy(self, a, like=None):
        return np.array(a, copy=True)

    def host_view(self, x):
        """A numpy view of host data (for host fast paths)."""
        return x

    def from_host(self, a):
        """A backend array over numpy array ``a`` (no copy where possible)."""
        return a

    def align(self, value, like):
        """``value`` on ``like``'s device (restored state); numpy has one device."""
        return value


NUMPY = NumpyBackend()

# The host fast paths (numpy arrays, CPU tensors): a callable ``(backend, codec, cols) ->
# encoder or None`` (see NumpyBackend.fused_encoder), or None.  Filled from outside the
# core, which holds only the reference chains.
_HOST_FAST_PATHS = None
_HOST_FAST_DECODERS = None  # the same for decoders (see NumpyBackend.fused_decoder)
_HOST_CHUNK_PATHS = None  # the two-phase exchange's chunk paths (NumpyBackend.chunk_path)


def set_host_fast_paths(provider, decoders=None, chunks=None):
    """Install ``provider`` as the host backends' source of fused encoders, ``decoders``
    as their source of fused decoders and ``chunks`` of the two-phase exchange's chunk
    paths (None: none); returns the previous pair."""
    global _HOST_FAST_PATHS, _HOST_FAST_DECODERS, _HOST_CHUNK_PATHS
    previous = (_HOST_FAST_PATHS, _HOST_FAST_DECODERS)
    _HOST_FAST_PATHS, _HOST_FAST_DECODERS, _HOST_CHUNK_PATHS = provider, decoders, chunks
    return previous


def host_fast_paths():
    """The installed host provider, or None (the torch backend serves CPU tensors from it)."""
    return _HOST_FAST_PATHS


def host_chunk_paths():
    """The installed provider of the two-phase exchange's chunk paths, or None."""
    return _HOST_CHUNK_PATHS


def host_fast_decoders():
    """The installed host decoder provider, or None."""
    return _HOST_FAST_DECODERS


_PARALLEL_DRAW = 1 << 20  # draws below this many values are not split
_DRAW_POOL = None


def _cpus() -> int:
    """The CPUs this process may run on (several ranks on a node each get theirs)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _forget_pool() -> None:
    """A forked child has none of the parent's threads: it makes its own pool."""
    global _DRAW_POOL
    _DRAW_POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def fill_uniform(gen, out):
    """``gen.random(len(out), dtype=float32, out=out)`` -- the same values, and ``gen``
    left in the same state -- drawn by several threads for a large ``out``.

    A PCG64 stream can be entered anywhere (``advance``), and float32 draws take the
    halves of its 64-bit outputs in order, so each thread draws a stretch of an even
    length from a copy of the generator advanced to where that stretch starts
    (numpy releases the GIL while it draws).  Another bit generator, or a small
    ``out``, is drawn as it is."""
    n = out.shape[0]
    workers = min(8, _cpus())
    bg = gen.bit_generator
    if n < _PARALLEL_DRAW or workers < 2 or not isinstance(bg, np.random.PCG64):
        return gen.random(n, dtype=np.float32, out=out)
    start = 0
    if bg.state["has_uint32"]:  # half of a 64-bit output is pending: take it first
        gen.random(1, dtype=np.float32, out=out[:1])
        start = 1
    state = bg.state
    step = (n - start) // workers // 2 * 2  # an even stretch: whole 64-bit outputs
    bounds = [start + w * step for w in range(workers)] + [n]
    parts = []
    for w in range(workers):
        part = np.random.PCG64()
        part.state = state
        part.advance(w * step // 2)
        parts.append(np.random.Generator(part))
    global _DRAW_POOL
    if _DRAW_POOL is None:
        from concurrent.futures import ThreadPoolExecutor
        _DRAW_POOL = ThreadPoolExecutor(8, thread_name_prefix="hvd-compress-draw")
    jobs = [_DRAW_POOL.submit(g.random, b - a, np.float32, out[a:b])
            for g, a, b in zip(parts, bounds, bounds[1:])]
    for job in jobs:
        job.result()
    bg.state = parts[-1].bit_generator.state  # where the last stretch ended
    return out


def prime_stride(stride: int) -> int:
    """The smallest prime at least ``stride`` (``stride`` itself below 3).  A sample of
    every ``s``-th value of a flattened matrix whose row length divides ``s`` sees one
    column only -- the main job's 80,000 x 256 classifier with ``s`` = 1,024 did -- and
    a threshold read from it misses by a factor of several; a prime stride walks
    through every column of any row length it does not divide."""
    if stride < 3:
        return max(1, stride)
    s = stride | 1
    while any(s % d == 0 for d in range(3, int(s ** 0.5) + 1, 2)):
        s += 2
    return s


def selection_sample(n: int, k: int):
    """How a host backend may find the k-th largest of ``n`` values faster than a full
    selection: ``(stride, want)`` -- take every ``stride``-th value, and the
    ``want``-th largest of that sample (a rank a bit beyond k's, for a margin) as a
    threshold below which few candidates remain -- or None where sampling does not
    pay (small ``n``, or ``k`` not far below ``n``).  The torch and TF backends share it;
    they check the candidates and widen or fall back when the margin falls short."""
    if n <= 65536 or k * 64 >= n:
        return None
    stride = prime_stride(max(1, n // 16384))
    m = -(-n // stride)  # len(x[::stride])
    return stride, min(m, int(k * m / n * 1.5) + 32)
