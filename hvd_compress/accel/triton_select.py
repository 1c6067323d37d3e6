"""The k largest entries' indices on CUDA tensors in Triton: a radix select of the k-th
largest value, then one compaction -- the core's canonical choice (every entry above
the k-th largest value, then the entries equal to it by increasing index until k are
taken, in increasing index order), which the torch chain makes from ``torch.topk``'s
k-th value, two compactions and a sort.

The values' float32 bits become order-preserving unsigned keys (-0.0 read as +0.0, as
the chain's comparisons take them).  Four passes find the k-th largest key a byte at a
time, from the top: each counts the next byte of the keys that share the bytes found
so far (a histogram per program, added into one of 256 bins), and a one-program step
picks the byte where the count from the top reaches the k still wanted.  Then a pass
counts each program's entries above and equal to the key, and the last writes each
chosen index at its place (cumulative sums within the program, and of the counts
before it).  Nothing is read on the host.  The magnitudes must be finite (NaN has no
place in the order; the core's magnitudes are).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .triton_kernels import launch

_CHUNK = 8192  # values a histogram program counts (fewer global additions)
_BLOCK = 1024  # values it takes at a time, and values a compaction program takes


@triton.jit
def _keys(x):
    """Order-preserving int64 keys of float32 ``x`` (-0.0 as +0.0)."""
    u = (x + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) == 1, ~u, u | 0x80000000).to(tl.int64)


@triton.jit
def radix_count(x_ptr, n, state_ptr, shift, high, hist_ptr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr):
    """Add to ``hist`` the byte at ``shift`` of the keys whose bits ``high`` equal the
    prefix found so far (``state[0]``)."""
    prefix = tl.load(state_ptr) & high
    counts = tl.zeros([256], tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = tl.program_id(0) * CHUNK + off + tl.arange(0, BLOCK)
        m = idx < n
        key = _keys(tl.load(x_ptr + idx, mask=m, other=0.0))
        digit = ((key >> shift) & 255).to(tl.int32)
        counts += tl.histogram(digit, 256, mask=m & ((key & high) == prefix))
    tl.atomic_add(hist_ptr + tl.arange(0, 256), counts)


@triton.jit
def radix_step(hist_ptr, state_ptr, shift, k, FIRST: tl.constexpr):
    """The byte at ``shift`` of the k-th largest key: the highest byte whose count from
    the top reaches the ``state[1]`` keys still wanted (``k`` at the first step); the
    keys above it are taken, so fewer are wanted after."""
    bins = tl.arange(0, 256)
    h = tl.load(hist_ptr + bins).to(tl.int64)
    if FIRST:
        want = k + tl.zeros([], tl.int64)  # (k may arrive as a constant: Triton makes 1 one)
    else:
        want = tl.load(state_ptr + 1)
    at_least = tl.cumsum(h, 0, reverse=True)  # keys whose byte is >= each bin
    byte = tl.sum((at_least >= want).to(tl.int64), 0) - 1
    above = tl.sum(tl.where(bins > byte, h, 0), 0)
    tl.store(state_ptr, tl.load(state_ptr) | (byte << shift))
    tl.store(state_ptr + 1, want - above)


@triton.jit
def count_chosen(x_ptr, n, state_ptr, counts_ptr, BLOCK: tl.constexpr):
    """``counts[program] = (keys above the k-th, keys equal to it)``."""
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    key = _keys(tl.load(x_ptr + idx, mask=m, other=0.0))
    kth = tl.load(state_ptr)
    tl.store(counts_ptr + 2 * pid, tl.sum((m & (key > kth)).to(tl.int64), 0))
    tl.store(counts_ptr + 2 * pid + 1, tl.sum((m & (key == kth)).to(tl.int64), 0))


@triton.jit
def write_chosen(x_ptr, n, state_ptr, before_ptr, out_ptr, BLOCK: tl.constexpr):
    """Each chosen index at its place: every key above the k-th, and the first
    ``state[1]`` keys equal to it (by index)."""
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    key = _keys(tl.load(x_ptr + idx, mask=m, other=0.0))
    kth = tl.load(state_ptr)
    room = tl.load(state_ptr + 1)
    above_before = tl.load(before_ptr + 2 * pid)
    equal_before = tl.load(before_ptr + 2 * pid + 1)
    equal = (m & (key == kth)).to(tl.int64)
    rank = equal_before + tl.cumsum(equal, 0) - equal
    chosen = ((m & (key > kth)) | ((equal == 1) & (rank < room))).to(tl.int64)
    at = above_before + tl.minimum(equal_before, room) + tl.cumsum(chosen, 0) - chosen
    tl.store(out_ptr + at, idx.to(tl.int64), mask=chosen == 1)


_BROKEN: list = []  # why the selection's kernels failed here once (then the chain)


def top_indices(B, mag, k: int):
    """Indices (int64, increasing) of the ``k`` largest entries of the flat float32
    ``mag``, ties to the lower index; None (the chain) where ``k`` is not in ``[1, n]``,
    ``mag`` is not float32, or the kernels failed to compile here (a triton without
    ``histogram``'s mask: one warning)."""
    n = mag.shape[0]
    if _BROKEN or not 1 <= k <= n or mag.dtype != torch.float32 or n + _CHUNK >= 2**31:
        return None
    try:
        return _select(mag, k)
    except Exception as exc:  # noqa: BLE001 - the hook may decline: the chain selects
        _BROKEN.append(exc)
        warnings.warn(f"hvd_compress: the Triton top-k selection failed ({type(exc).__name__}: "
                      f"{exc}); using the torch operations", RuntimeWarning, stacklevel=2)
        return None


def _select(mag, k: int):
    n = mag.shape[0]
    mag = mag.contiguous()
    state = torch.zeros(2, dtype=torch.int64, device=mag.device)
    hist = torch.zeros((4, 256), dtype=torch.int32, device=mag.device)
    for step, shift in enumerate((24, 16, 8, 0)):
        high = (0xFFFFFFFF << (shift + 8)) & 0xFFFFFFFF  # the bytes already found
        launch(radix_count, triton.cdiv(n, _CHUNK), mag, n, state, shift, high, hist[step],
               CHUNK=_CHUNK, BLOCK=_BLOCK)
        launch(radix_step, 1, hist[step], state, shift, k, FIRST=step == 0)
    programs = triton.cdiv(n, _BLOCK)
    counts = torch.empty((programs, 2), dtype=torch.int64, device=mag.device)
    launch(count_chosen, programs, mag, n, state, counts, BLOCK=_BLOCK)
    before = torch.cumsum(counts, 0) - counts
    out = torch.empty(k, dtype=torch.int64, device=mag.device)
    launch(write_chosen, programs, mag, n, state, before, out, BLOCK=_BLOCK)
    return out
