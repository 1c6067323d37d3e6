"""SketchML's encoder and decoder on CUDA tensors in Triton (Jiang et al., SIGMOD 2018;
the codec: :class:`~hvd_compress.core.levels.SketchMLCodec`).

The chain on the device makes a strided sample by an index list built in Python, the
bucket codes by ``searchsorted`` (int64), and each bucket's float64 sum and count by two
``index_add_`` of float64 copies into ``q`` bins (float atomics: 4.3 ms each on 25.6M
values on an H200), then the residual by a lookup.  Here:

- a sampling pass: the sample's values at ``j*n//m`` with NaN/Inf read as 0 (the chain's
  ``zero_nonfinite``), sorted by ``torch.sort`` as the chain sorts it, the edges at the
  codec's ranks (no arithmetic touches them);
- one codes pass: each value's code (how many edges are ``<=`` it, a binary search) and,
  per program, each bucket's float64 sum and count (a one-hot ``[SUB, Q]`` tile summed
  over its rows, sub-block after sub-block: a fixed order), the NaN/Inf count;
- a reduction of the programs' partial sums, row after row in a fixed order
  (deterministic: no float atomics), and the means by the codec's own helper;
- with error feedback, a pass for ``v - means[code]``.

The float64 sums are added in another order than the chain's (whose atomics have none);
the float32 means that come out are the same (tested).  Nothing is read on the host:
the payload's size is fixed.  Codes of 16 bits (``q > 256``) take the chain: the one-hot
tile grows with ``q``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import launch

INF = tl.constexpr(float("inf"))  # a jit function reads constexpr globals only
_SUB = 32  # values of a one-hot tile (its rows): SUB x Q float64 stay in registers
_COLS = 32  # buckets a program of the reduction adds up
_SUB_CPU, _COLS_CPU = 1024, 256  # the same in the interpreter (CPU tensors), where each
#                                  step of a program costs about 0.1 s, whatever its size
_CHUNK = 16384  # at most this many values a program of the codes pass (fewer partial rows)
_VALUES = 1024  # values a program of the sampling, residual and decoding passes


def _launch(kernel, programs: int, *args, **meta):
    launch(kernel, programs, *args, **meta)


def _wide(n: int) -> bool:
    """Whether indices of ``n`` values may pass int32 (2**31), with a chunk's margin."""
    return n + 2 * _CHUNK >= 2**31


@triton.jit
def _index(BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """The program's ``BLOCK`` indices (int64 where they may pass 2**31)."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    return pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _value(x_ptr, r_ptr, idx, m, HAS_R: tl.constexpr):
    """``x (+ r)`` at ``idx`` with NaN/Inf read as 0, and whether each was finite."""
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    fin = tl.abs(x) < INF
    return tl.where(fin, x, 0.0), fin


@triton.jit
def sketch_sample(x_ptr, r_ptr, n, m, out_ptr, HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    """``out[j] = v[j*n//m]`` for ``j < m`` (``v = x (+ r)``, NaN/Inf read as 0)."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < m
    x, _ = _value(x_ptr, r_ptr, j * n // m, ok, HAS_R)
    tl.store(out_ptr + j, x, mask=ok)


@triton.jit
def sketch_codes(x_ptr, r_ptr, edges_ptr, n, e, codes_ptr, sums_ptr, counts_ptr, bad_ptr,
                 HAS_R: tl.constexpr, Q: tl.constexpr, STEPS: tl.constexpr,
                 CHUNK: tl.constexpr, SUB: tl.constexpr, WIDE: tl.constexpr):
    """Per value of ``v = x (+ r)`` (NaN/Inf read as 0) its code, how many of the ``e``
    sorted edges are ``<= v`` (uint8); per program (``CHUNK`` values, ``SUB`` at a time)
    each of the ``Q`` buckets' float64 sum and int32 count, and the NaN/Inf count."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    buckets = tl.arange(0, Q)
    acc = tl.zeros([Q], tl.float64)
    cnt = tl.zeros([Q], tl.int32)
    bad = tl.zeros([SUB], tl.int32)
    for off in range(0, CHUNK, SUB):
        idx = pid * CHUNK + off + tl.arange(0, SUB)
        m = idx < n
        x, fin = _value(x_ptr, r_ptr, idx, m, HAS_R)
        bad += (m & (fin == 0)).to(tl.int32)
        lo = tl.zeros([SUB], tl.int32)
        hi = tl.zeros([SUB], tl.int32) + e
        for _ in range(STEPS):  # the chain's searchsorted(edges, v, right=True)
            active = lo < hi
            mid = (lo + hi) // 2
            below = tl.load(edges_ptr + mid, mask=active, other=0.0) <= x
            lo = tl.where(active & below, mid + 1, lo)
            hi = tl.where(active & (below == 0), mid, hi)
        tl.store(codes_ptr + idx, lo.to(tl.uint8), mask=m)
        hit = (lo[:, None] == buckets[None, :]) & m[:, None]
        acc += tl.sum(tl.where(hit, x.to(tl.float64)[:, None], 0.0), 0)
        cnt += tl.sum(hit.to(tl.int32), 0)
    tl.store(sums_ptr + pid * Q + buckets, acc)
    tl.store(counts_ptr + pid * Q + buckets, cnt)
    tl.store(bad_ptr + pid, tl.sum(bad, 0))


@triton.jit
def sketch_reduce(sums_ptr, counts_ptr, rows, q, out_sums_ptr, out_counts_ptr,
                  Q: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr):
    """Each bucket's sum over the ``rows`` programs' partial sums (float64) and counts
    (as float64, exact), ``ROWS`` rows at a time in order, then over those: a fixed order."""
    b = tl.program_id(0) * COLS + tl.arange(0, COLS)
    acc = tl.zeros([ROWS, COLS], tl.float64)
    cnt = tl.zeros([ROWS, COLS], tl.int64)
    for start in range(0, rows, ROWS):
        p = start + tl.arange(0, ROWS)
        at = p[:, None].to(tl.int64) * Q + b[None, :]
        ok = (p < rows)[:, None] & (b < q)[None, :]
        acc += tl.load(sums_ptr + at, mask=ok, other=0.0)
        cnt += tl.load(counts_ptr + at, mask=ok, other=0).to(tl.int64)
    tl.store(out_sums_ptr + b, tl.sum(acc, 0), mask=b < q)
    tl.store(out_counts_ptr + b, tl.sum(cnt, 0).to(tl.float64), mask=b < q)


@triton.jit
def sketch_residual(x_ptr, r_ptr, codes_ptr, means_ptr, n, res_ptr, HAS_R: tl.constexpr,
                    BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """The new residual ``v - means[code]`` (``v = x (+ r)``, NaN/Inf read as 0)."""
    idx = _index(BLOCK, WIDE)
    m = idx < n
    x, _ = _value(x_ptr, r_ptr, idx, m, HAS_R)
    code = tl.load(codes_ptr + idx, mask=m, other=0).to(tl.int32)
    tl.store(res_ptr + idx, x - tl.load(means_ptr + code, mask=m, other=0.0), mask=m)


@triton.jit
def sketch_decode(codes_ptr, means_ptr, n, out_ptr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """``means[code]``."""
    idx = _index(BLOCK, WIDE)
    m = idx < n
    code = tl.load(codes_ptr + idx, mask=m, other=0).to(tl.int32)
    tl.store(out_ptr + idx, tl.load(means_ptr + code, mask=m, other=0.0), mask=m)


_RANKS: dict = {}  # the sample's ranks of the edges, by (device, m, q): no copy per call


def _ranks(codec, m: int, like):
    key = (str(like.device), m, codec.q)
    t = _RANKS.get(key)
    if t is None:
        t = _RANKS[key] = torch.tensor([j * m // codec.q for j in range(1, codec.q)],
                                       dtype=torch.int64, device=like.device)
    return t


def _chunk(n: int, sub: int) -> int:
    """Values a program of the codes pass takes: about a thousand programs where ``n``
    allows, at least a tile of ``sub`` and at most :data:`_CHUNK`."""
    return max(sub, min(_CHUNK, triton.next_power_of_2(-(-n // 1024))))


def bucket_sums(g, residual, edges, q: int, sub: int | None = None, rows_at_once: int = 64):
    """``(codes uint8[n], sums float64[q], counts float64[q], bad int32[programs])`` of
    ``v = g (+ residual)`` against the sorted ``edges`` (``q - 1`` of them); one-hot tiles
    of ``sub`` values (default: :data:`_SUB` on a GPU, :data:`_SUB_CPU` interpreted), the
    programs' partial rows reduced ``rows_at_once`` at a time (a power of 2)."""
    n = g.shape[0]
    sub = sub or (_SUB if g.is_cuda else _SUB_CPU)
    chunk, cols = _chunk(n, sub), min(_COLS if g.is_cuda else _COLS_CPU, triton.next_power_of_2(q))
    width = max(2, triton.next_power_of_2(q))
    rows = -(-n // chunk)
    part_sums = torch.empty(rows * width, dtype=torch.float64, device=g.device)
    part_counts = torch.empty(rows * width, dtype=torch.int32, device=g.device)
    bad = torch.empty(rows, dtype=torch.int32, device=g.device)
    codes = torch.empty(n, dtype=torch.uint8, device=g.device)
    _launch(sketch_codes, rows, g, g if residual is None else residual, edges, n, q - 1, codes,
            part_sums, part_counts, bad, HAS_R=residual is not None, Q=width,
            STEPS=max(1, (q - 1).bit_length()), CHUNK=chunk, SUB=sub, WIDE=_wide(n))
    sums = torch.empty(q, dtype=torch.float64, device=g.device)
    counts = torch.empty(q, dtype=torch.float64, device=g.device)
    _launch(sketch_reduce, -(-q // cols), part_sums, part_counts, rows, q, sums, counts,
            Q=width, COLS=cols, ROWS=rows_at_once)
    return codes, sums, counts, bad


def encoder(B, codec, cols):
    """SketchML's fused encoder (``(g, residual, noise, noise_source) -> (fields,
    residual, finite)``), or None for codes of 16 bits (the chain)."""
    if cols != 1 or codec.q > 256:
        return None

    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        m = min(n, codec.sample)
        sample = torch.empty(m, dtype=torch.float32, device=g.device)
        _launch(sketch_sample, -(-m // _VALUES), g, g if residual is None else residual, n, m,
                sample, HAS_R=residual is not None, BLOCK=_VALUES)
        edges = B.gather(B.sort(sample), _ranks(codec, m, g)).contiguous()
        codes, sums, counts, bad = bucket_sums(g, residual, edges, codec.q)
        means = codec.means(B, sums, counts)
        res = None
        if residual is not None:
            res = torch.empty_like(g)
            _launch(sketch_residual, -(-n // _VALUES), g, residual, codes, means, n, res,
                    HAS_R=True, BLOCK=_VALUES, WIDE=_wide(n))
        return {"means": means, "codes": codes}, res, bad.amax() == 0
    return encode


def decoder(B, codec, cols):
    """``means[code]`` in one pass (the chain widens the codes to int32, then gathers)."""
    if cols != 1 or codec.q > 256:
        return None

    def decode(fields, n):
        codes = fields["codes"].contiguous()
        out = torch.empty(n, dtype=torch.float32, device=codes.device)
        _launch(sketch_decode, -(-n // _VALUES), codes, fields["means"].contiguous(), n, out,
                BLOCK=_VALUES, WIDE=_wide(n))
        return out
    return decode
