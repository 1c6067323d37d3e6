"""The device paths' wrappers: QSGD, TernGrad, uniform max-min quantization and natural
compression as a statistics pass and a codes pass each (codes, packing and the
error-feedback residual in one), natural's decoding, and the packed codes' decoding as
one pass (every codec that decodes through
:func:`~hvd_compress.core.bitpack.unpack_values`: QSGD, TernGrad, 1-bit, threshold, the
sign methods; uniform's with its bucket minimums added).  Kernels:
:mod:`.triton_kernels`; INCEPTIONN's and the top-k selection's wrappers beside theirs;
the tables at the end are what :mod:`.device` chooses from.

The same bits as the torch chain on the device: the noise is drawn as the chain draws
it (the compressor's generator, ``torch.rand`` on the tensor's device, the same
values in the same order; nothing else draws from it), the scales come from the
codecs' own helpers on the few per-bucket values, and the kernels keep the chain's
roundings.  No value is read on the host: finiteness is a 0-d tensor (the core flags
the payload's floats and keeps the old residual on it).
"""

from __future__ import annotations

import torch
import triton

from ..core.bitpack import packed_nbytes
from ..core.dgc import Lowering, MomentumPasses
from ..core.levels import EightBitCodec, NaturalCodec, SketchMLCodec, UniformCodec
from ..core.onebit import OneBitCodec
from ..core.qsgd import QSGDCodec
from ..core.sampling import Stratified
from ..core.signs import SignCodec, SignumCodec
from ..core.terngrad import TernGradCodec
from ..core.threshold import ThresholdCodec
from ..core.variable import Inceptionn, SignCounts, ThresholdV
from . import triton_dgc, triton_dgc_momentum, triton_inceptionn, triton_signs, triton_sketchml
from . import triton_kernels as K
from .registry import ByClass
from .triton_select import top_indices

__all__ = ["ENCODERS", "DECODERS", "SLOWER_ON_CUDA", "unpack", "top_indices", "probe"]

_VALUES = 1024  # values a program of the codes and decoding kernels handles
_CHUNK = 8192  # values a program of TernGrad's statistics pass sums


def _launch(kernel, programs: int, *args, **meta):
    K.launch(kernel, programs, *args, **meta)


def _wide(n: int, d: int = 1) -> bool:
    """Whether indices of ``n`` values in buckets of ``d`` may pass int32 (2**31)."""
    return n + d + 2 * _VALUES >= 2**31


def _stats(x, r, d: int, *, sums=False, minmax=False, top=False, absolute=False):
    """Per bucket of ``d`` values of ``x (+ r)``: ``(sum, sumsq, lo, hi, top, bad)``, the
    ones not asked for None (``absolute``: the sum of |v|); ``bad`` counts the NaN/Inf
    entries (read as 0)."""
    n = x.shape[0]
    nb = -(-n // d)
    f64 = lambda: torch.empty(nb, dtype=torch.float64, device=x.device)  # noqa: E731
    f32 = lambda: torch.empty(nb, dtype=torch.float32, device=x.device)  # noqa: E731
    s1, s2 = (f64(), f64()) if sums else (None, None)
    lo, hi = (f32(), f32()) if minmax else (None, None)
    mx = f32() if top else None
    bad = torch.empty(nb, dtype=torch.int32, device=x.device)
    block = min(triton.next_power_of_2(d), 1024)
    rows = max(1, 1024 // block)  # buckets a program: small ones share (1,024 values a time)
    _launch(K.bucket_stats, -(-nb // rows), x, x if r is None else r, n, d, nb,
            *(a if a is not None else bad for a in (s1, s2, lo, hi, mx)), bad,
            HAS_R=r is not None, SUMS=sums, MINMAX=minmax, TOP=top, ABS=absolute, ROWS=rows,
            BLOCK=block, WIDE=_wide(n, d))
    return s1, s2, lo, hi, mx, bad


def _finite(bad):
    """The step's finiteness as a 0-d bool tensor (no host read)."""
    return bad.amax() == 0


def _codes_out(x, n: int, bits: int, ef: bool):
    """Fresh packed codes and, with error feedback, a fresh residual."""
    codes = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    return codes, (torch.empty_like(x) if ef else None)


def _noise(codec, noise, noise_source, g):
    """The noise given, else drawn as the chain draws it (the compressor's generator)."""
    if not codec.needs_noise:
        return g
    return noise.contiguous() if noise is not None else noise_source.draw(g.shape[0], like=g)


def _qsgd_encoder(B, codec, cols):
    if cols != 1 or 8 % codec.bits:
        return None  # codes across byte boundaries: the chain
    bits, d, s = codec.bits, codec.d, codec.s
    per = 8 // bits

    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        u = _noise(codec, noise, noise_source, g)
        _, sumsq, _, _, _, bad = _stats(g, residual, d, sums=True)
        norms, inv = codec.scales(B, g, sumsq)
        f = codec.factors(B, norms) if residual is not None else inv
        codes, res = _codes_out(g, n, bits, residual is not None)
        _launch(K.qsgd_codes, -(-codes.shape[0] // (_VALUES // per)), g,
                g if residual is None else residual, u, B.cast(inv, "float32"), f, n,
                codes.shape[0], d, s, float(s), codes, codes if res is None else res,
                HAS_R=residual is not None, BITS=bits, PER=per, BYTES=_VALUES // per,
                WIDE=_wide(n, d))
        return {"norms": norms, "codes": codes}, res, _finite(bad)
    return encode


def _terngrad_encoder(B, codec, cols):
    clip = codec.clip

    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        u = _noise(codec, noise, noise_source, g)
        s1, s2, _, _, top, bad = _stats(g, residual, _CHUNK, sums=clip > 0, top=True)
        top = top.amax()
        if clip > 0:  # the chain's max(min(|v|, cap)) is min(max|v|, cap)
            cap = clip * codec.sigma(B, s1.sum(), s2.sum(), n)
            scale = torch.minimum(top, cap)
        else:
            cap = scale = top
        safe = B.where(scale > 0, scale, 1.0)
        codes, res = _codes_out(g, n, 2, residual is not None)
        _launch(K.terngrad_codes, -(-codes.shape[0] // (_VALUES // 4)), g,
                g if residual is None else residual, u, cap.reshape(1), safe.reshape(1),
                scale.reshape(1), n, codes.shape[0], codes, codes if res is None else res,
                HAS_R=residual is not None, CLIP=clip > 0, BYTES=_VALUES // 4, WIDE=_wide(n))
        return {"scale": scale.reshape(1), "codes": codes}, res, _finite(bad)
    return encode


def _uniform_encoder(B, codec, cols):
    if cols != 1 or 8 % codec.bits:
        return None
    bits, d = codec.bits, codec.d
    per = 8 // bits

    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        u = _noise(codec, noise, noise_source, g)
        _, _, lo, hi, _, bad = _stats(g, residual, d, minmax=True)
        scale, inv = codec.scales(B, lo, hi)
        codes, res = _codes_out(g, n, bits, residual is not None)
        _launch(K.uniform_codes, -(-codes.shape[0] // (_VALUES // per)), g,
                g if residual is None else residual, u, inv, lo * inv, scale, lo, n,
                codes.shape[0], d, float(codec.levels), codes, codes if res is None else res,
                HAS_R=residual is not None, STOCHASTIC=codec.needs_noise, BITS=bits, PER=per,
                BYTES=_VALUES // per, WIDE=_wide(n, d))
        return {"mins": lo, "scales": scale, "codes": codes}, res, _finite(bad)
    return encode


_TABLES: dict = {}  # value tables given as lists, on their devices (no copy per call)


def _table(values, like):
    """``values`` (a list of floats, or a tensor) as a float32 tensor on ``like``'s device."""
    if isinstance(values, torch.Tensor):
        return values.to(torch.float32).contiguous()
    key = (str(like.device), tuple(values))
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=like.device)
    return t


def _unpack(data, bits: int, n: int, table, factors, lo, d):
    per = 8 // bits
    nbytes = min(data.shape[0], packed_nbytes(n, bits))
    out = torch.empty(n, dtype=torch.float32, device=data.device)
    f = factors.contiguous() if factors is not None else table
    add = lo.contiguous() if lo is not None else table
    _launch(K.unpack_values, -(-nbytes // (_VALUES // per)), data.contiguous(), table, f, add, n,
            nbytes, d or 1, out, HAS_F=factors is not None, HAS_LO=lo is not None, BITS=bits,
            PER=per, BYTES=_VALUES // per, WIDE=_wide(n, d or 1))
    return out


def unpack(B, data, bits, n, values, factors=None, d=None):
    """``values[code] (* factors[i // d])`` of ``n`` packed codes (1, 2, 4 or 8 bits)."""
    return _unpack(data, bits, n, _table(values, data), factors, None, d)


def _sign_encoder(B, codec, cols):
    """signSGD's scale (1, or 0 for an all-zero tensor) or EF-signSGD's (``||v||_1 / n``)
    from the statistics pass, then the sign bits (and the residual) in one pass."""
    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        s1, _, _, _, top, bad = _stats(g, residual, _CHUNK, sums=codec.scaled,
                                       top=not codec.scaled, absolute=True)
        if codec.scaled:
            scale = B.cast(B.div(s1.sum(), float(n)), "float32")
        else:
            scale = B.cast(top.amax() > 0, "float32")
        signs, res = _codes_out(g, n, 1, residual is not None)
        _launch(K.sign_codes, -(-signs.shape[0] // (_VALUES // 8)), g,
                g if residual is None else residual, scale.reshape(1), n, signs.shape[0],
                signs, signs if res is None else res, HAS_R=residual is not None,
                BYTES=_VALUES // 8, WIDE=_wide(n))
        return {"scale": scale.reshape(1), "signs": signs}, res, _finite(bad)
    return encode


_POWERS: dict = {}  # natural's 256 values (NaN among them), eightbit's tables, by device


def _threshold_encoder(B, codec, cols):
    """2-bit threshold codes and the residual in one pass (the NaN/Inf count before)."""
    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        bad = _stats(g, residual, _CHUNK)[5]
        codes, res = _codes_out(g, n, 2, residual is not None)
        _launch(K.threshold_codes, -(-codes.shape[0] // (_VALUES // 4)), g,
                g if residual is None else residual, n, codes.shape[0], codec.tau, codes,
                codes if res is None else res, HAS_R=residual is not None, BYTES=_VALUES // 4,
                WIDE=_wide(n))
        scale = B.scalar(codec.tau, like=g).reshape(1)
        return {"scale": scale, "codes": codes}, res, _finite(bad)
    return encode


def _eightbit_tables(codec, like):
    """The 255 rounding edges and 256 levels of the dynamic tree type, on ``like``'s device."""
    key = ("eightbit", str(like.device))
    if key not in _POWERS:
        _POWERS[key] = tuple(torch.from_numpy(a.copy()).to(like.device)
                             for a in (codec.edges, codec.levels))
    return _POWERS[key]


def _eightbit_encoder(B, codec, cols):
    """max |v| from the statistics pass, the scale and its inverse by the codec's helpers,
    then the codes (a binary search of the edges) and the residual in one pass."""
    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        _, _, _, _, top, bad = _stats(g, residual, _CHUNK, top=True)
        s = codec.scale(B, top.amax())
        inv = codec.inverse(B, s)
        edges, levels = _eightbit_tables(codec, g)
        codes = torch.empty(n, dtype=torch.uint8, device=g.device)
        res = torch.empty_like(g) if residual is not None else None
        scale = B.cast(s, "float32").reshape(1)
        _launch(K.eightbit_codes, -(-n // _VALUES), g, g if residual is None else residual,
                inv.reshape(1), scale, edges, levels, n, codes, codes if res is None else res,
                HAS_R=residual is not None, BLOCK=_VALUES, WIDE=_wide(n))
        return {"scale": scale, "codes": codes}, res, _finite(bad)
    return encode


def _eightbit_decoder(B, codec, cols):
    def decode(fields, n):
        out = torch.empty(n, dtype=torch.float32, device=fields["codes"].device)
        _launch(K.eightbit_decode, -(-n // _VALUES), fields["codes"].contiguous(),
                _eightbit_tables(codec, out)[1], fields["scale"].contiguous(), n, out,
                BLOCK=_VALUES, WIDE=_wide(n))
        return out
    return decode


def _powers(codec, like):
    key = str(like.device)
    if key not in _POWERS:
        _POWERS[key] = torch.from_numpy(codec.powers.copy()).to(like.device)
    return _POWERS[key]


def _natural_encoder(B, codec, cols):
    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        u = _noise(codec, noise, noise_source, g)
        bad = _stats(g, residual, _CHUNK)[5].sum()  # the flag: every code 255 where not 0
        exps = torch.empty(n, dtype=torch.uint8, device=g.device)
        signs, res = _codes_out(g, n, 1, residual is not None)
        _launch(K.natural_codes, -(-signs.shape[0] // (_VALUES // 8)), g,
                g if residual is None else residual, u, bad, _powers(codec, g), n,
                signs.shape[0], exps, signs, signs if res is None else res,
                HAS_R=residual is not None, BYTES=_VALUES // 8, WIDE=_wide(n))
        return {"exps": exps, "signs": signs}, res, bad == 0
    return encode


def _natural_decoder(B, codec, cols):
    def decode(fields, n):
        out = torch.empty(n, dtype=torch.float32, device=fields["exps"].device)
        _launch(K.natural_decode, -(-n // _VALUES), fields["exps"].contiguous(),
                fields["signs"].contiguous(), _powers(codec, out), n, out,
                BYTES=_VALUES // 8, WIDE=_wide(n))
        return out
    return decode


def _stratified(B, marker, cols):
    """Random-k's and DGC's stratified sample (``(n, k, key0, key1) -> (indices, sizes)``)
    in one pass over the strata (the chain makes about twenty)."""
    def sample(n, k, key0, key1):  # the keys: 0-d tensors on the device (core.sampling)
        at = next((t.device for t in (key0, key1) if isinstance(t, torch.Tensor)), None)
        keys = [t.reshape(1).to(torch.int64) if isinstance(t, torch.Tensor)
                else torch.full((1,), int(t), dtype=torch.int64, device=at) for t in (key0, key1)]
        indices = torch.empty(k, dtype=torch.int64, device=keys[0].device)
        sizes = torch.empty(k, dtype=torch.int64, device=keys[0].device)
        _launch(K.stratified, -(-k // _VALUES), *keys, n, k, indices, sizes, BLOCK=_VALUES)
        return indices, sizes
    return sample


def probe(device) -> bool:
    """Whether a small decode runs on ``device`` and gives the chain's values."""
    data = torch.tensor([0b11100100, 0b00011011], dtype=torch.uint8, device=device)
    got = _unpack(data, 2, 7, _table([0.5, 1.5, -2.0, 4.0], data), None, None, 1)
    return got.tolist() == [0.5, 1.5, -2.0, 4.0, 4.0, -2.0, 1.5]


def _uniform_decoder(B, codec, cols):
    if cols != 1 or 8 % codec.bits:
        return None
    steps = [float(c) for c in range(1 << codec.bits)]
    return lambda fields, n: _unpack(fields["codes"], codec.bits, n, _table(steps, fields["codes"]),
                                     fields["scales"], fields["mins"], codec.d)


#: the fused encoders' makers ``(B, obj, cols) -> encoder or None``, by codec or compressor
#: class (INCEPTIONN's whole payload: :mod:`.triton_inceptionn`; DGC's correction loop and
#: adaq's sign counts: :mod:`.triton_dgc`; DGC's momentum and masking:
#: :mod:`.triton_dgc_momentum`; Signum's, 1-bit SGD's and threshold-v's:
#: :mod:`.triton_signs`)
ENCODERS = ByClass({QSGDCodec: _qsgd_encoder, TernGradCodec: _terngrad_encoder,
                    UniformCodec: _uniform_encoder, NaturalCodec: _natural_encoder,
                    SignCodec: _sign_encoder, SignumCodec: triton_signs.signum_encoder,
                    OneBitCodec: triton_signs.onebit_encoder,
                    ThresholdV: triton_signs.threshold_v_encoder,
                    ThresholdCodec: _threshold_encoder, EightBitCodec: _eightbit_encoder,
                    Inceptionn: triton_inceptionn.encoder, Stratified: _stratified,
                    Lowering: triton_dgc.lowering, SignCounts: triton_dgc.signs,
                    MomentumPasses: triton_dgc_momentum.passes,
                    SketchMLCodec: triton_sketchml.encoder})
#: the kernels measured slower than the torch chain they replace, on an NVIDIA H200
#: (``bench_kernels.py --framework torch --device cuda``, 25,557,032 values, 2026-11-28):
#: on CUDA devices the chain runs unless ``HVD_COMPRESS_TRITON=all`` (:mod:`.device`)
SLOWER_ON_CUDA = ByClass({Inceptionn: "encode 4.61 ms against the chain's 2.40, "
                                      "decode 4.46 against 1.17"})
#: the fused decoders' makers (the quantizers' others decode through :func:`unpack`)
DECODERS = ByClass({UniformCodec: _uniform_decoder, NaturalCodec: _natural_decoder,
                    EightBitCodec: _eightbit_decoder, OneBitCodec: triton_signs.onebit_decoder,
                    Inceptionn: triton_inceptionn.decoder, SketchMLCodec: triton_sketchml.decoder})
