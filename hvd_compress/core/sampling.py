"""Randomness that every rank and every framework computes identically.

Random-k's indices and DGC's threshold sample must be the same on all ranks
for a given (seed, step, tensor name), and the same in numpy, PyTorch and
TensorFlow, without touching any global RNG the user's code also draws from.
They come from a counter-based hash: element ``i`` of a stream keyed by
``key`` is ``hash32(hash32(i ^ key0) ^ key1)``, with the 32-bit integer
finaliser "lowbias32" (C. Wellons, 2018).  The arithmetic is done in int64 and
masked to 32 bits, which numpy, torch and tensorflow all compute the same way.

Stochastic rounding noise (QSGD, TernGrad), which must differ between ranks,
comes instead from a generator the compressor owns (``Backend.generator``) or
is passed in explicitly.
"""

from __future__ import annotations

import zlib

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def hash32(B, x):
    """lowbias32 on int64 arrays holding values in [0, 2**32)."""
    x = B.bit_xor(x, B.shift_right(x, 16))
    x = B.mul_low32(x, 0x7FEB352D)
    x = B.bit_xor(x, B.shift_right(x, 15))
    x = B.mul_low32(x, 0x846CA68B)
    return B.bit_xor(x, B.shift_right(x, 16))


def name_key(name: str) -> int:
    """A 32-bit constant for a tensor name (CRC-32 of its UTF-8 bytes)."""
    return zlib.crc32(name.encode("utf-8")) & MASK32


class _Ints:
    """Python ints as :func:`hash32`'s backend: the same 32-bit arithmetic, for keys
    whose inputs are all on the host (a few dozen tensor operations a tensor and step
    saved)."""

    @staticmethod
    def bit_xor(x, y):
        return x ^ y

    @staticmethod
    def shift_right(x, s):
        return x >> s

    @staticmethod
    def mul_low32(x, c):
        return (x * c) & MASK32


def name_base(seed: int, name: str, purpose: int) -> int:
    """The part of :func:`stream_keys` that does not depend on the step (a Python int)."""
    base = hash32(_Ints, (seed * GOLDEN + purpose) & MASK32)
    return hash32(_Ints, base ^ name_key(name))


def step_keys(ops, base, step, golden=GOLDEN):
    """:func:`stream_keys` from :func:`name_base`'s ``base`` and ``step`` (masked to 32
    bits), in ``ops``' arithmetic: Python ints, or a backend's arrays (one key pair per
    element where ``base`` and ``step`` are arrays)."""
    key0 = hash32(ops, ops.bit_xor(base, step))
    return key0, hash32(ops, ops.bit_xor(key0, golden))


def stream_keys(B, seed: int, name: str, step, purpose: int, like=None):
    """Two 0-d int64 keys for the stream of (seed, tensor name, step, purpose).

    ``step`` may be a Python int or a 0-d int64 array (a framework variable),
    so the keys can be derived inside a traced function without the host.  What
    does not depend on the step is computed on Python ints (:class:`_Ints`); so is
    the rest when the step is a Python int, the keys then made arrays.
    """
    base = name_base(seed, name, purpose)
    if isinstance(step, int):
        key0, key1 = step_keys(_Ints, base, step & MASK32)
        return B.scalar(key0, "int64", like=like), B.scalar(key1, "int64", like=like)
    return step_keys(B, B.scalar(base, "int64", like=like),
                     B.bit_and(B.cast(step, "int64"), MASK32),
                     B.scalar(GOLDEN, "int64", like=like))


def hash_stream(B, key0, key1, n: int, like=None):
    """``n`` uniformly distributed 32-bit integers (int64 array) of the keyed stream."""
    i = B.arange(n, "int64", like=like)
    return hash32(B, B.bit_xor(hash32(B, B.bit_xor(i, key0)), key1))


class Stratified:
    """What :func:`stratified_indices` asks the backend's fast-path hook for
    (``B.fused_encoder(STRATIFIED, 1, like)``): a callable ``(n, k, key0, key1) ->
    (indices, sizes)`` with this function's values, or None (then the chain below)."""

    name = "stratified"


STRATIFIED = Stratified()


def stratified_indices(B, n: int, k: int, key0, key1, like=None):
    """``k`` distinct indices in ``[0, n)``, one drawn uniformly from each of ``k`` strata.

    Stratum ``j`` is ``[floor(j*n/k), floor((j+1)*n/k))``; its index is
    ``lo_j + floor(h_j * size_j / 2**32)`` for the keyed hash ``h_j``.  Each
    coordinate is chosen with probability ``1/size_j`` (about ``k/n``, as in
    random-k), the k indices come out distinct and sorted, and the work is
    O(k) on any device.  Returns ``(indices, sizes)``, both int64.
    """
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    fast = B.fused_encoder(STRATIFIED, 1, like=like)
    if fast is not None:
        return fast(n, k, key0, key1)
    j = B.arange(k + 1, "int64", like=like)
    bounds = (j * n) // k
    lo, hi = bounds[:-1], bounds[1:]
    sizes = hi - lo
    h = hash_stream(B, key0, key1, k, like=like)
    offset = B.shift_right(h * sizes, 32)  # < 2**32 * n < 2**63: no overflow
    return lo + offset, sizes
