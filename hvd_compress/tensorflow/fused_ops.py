"""Fused TensorFlow CPU ops for the quantizers, the sparsifiers and PowerSGD's products:
built from ``fused/quantize_ops.cc``, ``fused/sparse_ops.cc`` and ``fused/lowrank_ops.cc``
into one library.

Run as the core's chain of TensorFlow ops, a quantizer makes a pass over
memory, and a fresh tensor, per element-wise step: 15-40 times the cost of
copying the gradient.  The custom ops in ``fused/quantize_ops.cc`` do one
codec's whole per-element work (error-feedback sum, statistics, codes, bit
packing, new residual, finiteness) in one or two passes, and decoding in one,
with the core's float32 arithmetic, so payloads keep the same bits (tested
against the numpy reference).  They run in eager mode and inside
``tf.function``, on CPU only: where a GPU is visible the chain runs.

The library is compiled on first use -- ``scripts/setup.sh`` does it ahead, by
``python -m hvd_compress.tensorflow.fused_ops`` -- with the compiler and flags
TensorFlow names (``tf.sysconfig``) into
``~/.cache/hvd-compress/tfops/<key>/``, the key a hash of the source,
TensorFlow's version, the flags and the compiler.  ``HVD_COMPRESS_FUSED=0``
turns the ops off; if they cannot be built, a warning says why and the chain
runs.

Noise: with ``noise=None`` the TernGrad and QSGD ops draw one 64-bit key per
tensor and step from the compressor's generator and hash it with each
element's index (uniform on [0, 1) with 24 random bits), instead of
materialising a noise tensor, which alone costs about 7 copies; the noise
stream therefore differs from the chain's (both are uniform).  Explicit
noise gives the reference's bits.

PowerSGD (:func:`lowrank`): its products with a thin factor (``M Q``, ``M^T P``,
``P Q^T``), the residual ``M - P Q^T`` and the finiteness check each take one
pass, where TensorFlow's ops materialise a transpose, run general products that
are slow for a few columns, and subtract in a pass of their own.  Long sums
go to float64 by short float32 blocks, in a fixed order: results agree with
the numpy reference's float32 products to rounding (tested), and do not depend
on the number of threads.

Sparsifiers: top-k's and random-k's encoding (error-feedback sum, selection or
gather, new residual) and DGC's (momentum correction, sampled threshold and
correction loop, selection, masking) are one op each, and decoding scatters
into a zeroed tensor in one (``scatter_add``); the selection is the core's
(the k largest magnitudes, ties to the lower index), found from counts of the
values' float32 bit patterns, so payloads and state keep the reference's
bits.  Random-k's indices and DGC's sample positions come from the core
(:mod:`hvd_compress.core.sampling`), as TF ops on k or s elements.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

from ..accel.registry import ByClass, requested
from ..core.dgc import DGC
from ..core.onebit import OneBitCodec
from ..core.qsgd import QSGDCodec
from ..core.sampling import Stratified
from ..core.sparsifiers import RandomK, TopK
from ..core.terngrad import TernGradCodec
from ..core.threshold import ThresholdCodec

SOURCE = Path(__file__).with_name("fused") / "quantize_ops.cc"
#: every source of the one library: the quantizers' ops, the sparsifiers' and PowerSGD's products
SOURCES = [SOURCE, SOURCE.with_name("sparse_ops.cc"), SOURCE.with_name("lowrank_ops.cc")]
_FLAGS = ["-shared", "-fPIC", "-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math",
          "-Wno-deprecated-declarations"]

_LIB = None  # the loaded op module, False after a failure
_ERROR = ""


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hvd-compress" / "tfops"


def _cpu_flags() -> list:
    """-mavx2 where the CPU has it (the element-wise loops vectorise 8 wide)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return ["-mavx2"] if " avx2" in line else []
    except OSError:
        pass
    return []


def _command(out: Path) -> list:
    import tensorflow as tf
    cxx = shlex.split(os.environ.get("CXX", "g++"))
    return (cxx + _FLAGS + _cpu_flags() + list(tf.sysconfig.get_compile_flags())
            + [str(src) for src in SOURCES] + ["-o", str(out)] + list(tf.sysconfig.get_link_flags()))


def library_path() -> Path:
    """Where the library for this source, TensorFlow, compiler and flags lives."""
    import tensorflow as tf
    probe = _command(Path("OUT"))
    try:
        version = subprocess.run(probe[:1] + ["--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = ["no compiler"]
    h = hashlib.sha256()
    names = {str(src) for src in SOURCES}
    flags = [a for a in probe if a not in names]  # the sources by content, not by where they lie
    parts = [src.read_bytes() for src in SOURCES] + [tf.__version__.encode(), " ".join(flags).encode()]
    for part in parts + [v.encode() for v in version]:
        h.update(part)
        h.update(b"\0")
    return _cache_root() / h.hexdigest()[:16] / "hvdc_quantize_ops.so"


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (ranks started together build once)."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(verbose: bool = False) -> Path:
    """Compile the library unless the cache has it; returns its path (raises on failure)."""
    out = library_path()
    if out.exists():
        return out
    with _locked(out.parent / "build.lock"):
        if out.exists():  # another process built it meanwhile
            return out
        tmp = out.with_suffix(f".tmp{os.getpid()}.so")
        cmd = _command(tmp)
        if verbose:
            print(" ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            names = ", ".join(src.name for src in SOURCES)
            raise RuntimeError(f"compiling {names} failed ({cmd[0]} exit {proc.returncode}):\n"
                               + "\n".join(proc.stderr.splitlines()[-20:]))
        os.replace(tmp, out)
    return out


def library():
    """The loaded op module, or None (turned off, or not buildable: warned once)."""
    global _LIB, _ERROR
    if not requested():
        return None
    if _LIB is None:
        try:
            import tensorflow as tf
            _LIB = tf.load_op_library(str(build()))
        except Exception as exc:  # noqa: BLE001 - any failure means: run the chain
            _LIB, _ERROR = False, f"{type(exc).__name__}: {exc}"
            warnings.warn(f"hvd_compress: fused TensorFlow ops unavailable, the quantizers and "
                          f"sparsifiers run as chains of TF ops ({_ERROR})", RuntimeWarning, stacklevel=2)
    return _LIB or None


def error() -> str:
    """Why the library could not be loaded ("" if it was, or was not tried)."""
    return _ERROR


# -- the ops, registered against the algorithm's class ------------------------------------
#: how to make the compiled ops' encoder for an object of a class (a codec, a compressor, or
#: core.sampling's marker): ``(lib, obj, cols) -> encoder or None``, found along the MRO
ENCODERS = ByClass()


def register(cls, make) -> None:
    """Register ``make(lib, obj, cols)`` as the compiled ops' encoder maker for ``cls``."""
    ENCODERS[cls] = make


def encoder(codec, cols: int):
    """A fused encoder for ``codec`` -- a quantizer's: ``(g, residual, noise, noise_source)
    -> (fields, new residual, finite)``, ``finite`` a 0-d tensor; a sparsifier's (``codec``
    is the compressor): the callable its ``_encode_fused`` expects -- or None where there is
    none (other classes).  ``cols``: 1-bit SGD's columns."""
    lib = library()
    make = None if lib is None else ENCODERS.find(codec)
    return None if make is None else make(lib, codec, cols)


def _quantizer(op):
    """An encoder maker for a quantizer codec whose op is wrapped by ``op(lib, tf, codec,
    cols, g, residual, noise, gen)``."""
    def make(lib, codec, cols):
        import tensorflow as tf

        def encode(g, residual, noise, noise_source):
            residual = _empty(tf) if residual is None else residual
            gen = None if noise_source is None else noise_source.gen
            return op(lib, tf, codec, cols, g, residual, noise, gen)
        return encode
    return make


def _empty(tf):
    return tf.zeros([0], tf.float32)


def _noise_inputs(tf, noise, gen):
    """(noise, key): explicit noise, or none and one key drawn from the generator."""
    if noise is not None:
        return noise, tf.zeros([1], tf.int64)
    return _empty(tf), gen.uniform_full_int([1], tf.int64)


def _threshold(lib, tf, codec, cols, g, residual, noise, gen):
    codes, rout, finite = lib.hvdc_threshold_encode(g, residual, tau=codec.tau)
    return {"scale": tf.constant([codec.tau], tf.float32), "codes": codes}, rout, finite


def _onebit(lib, tf, codec, cols, g, residual, noise, gen):
    pos, neg, signs, rout, finite = lib.hvdc_onebit_encode(g, residual, cols=cols)
    return {"pos": pos, "neg": neg, "signs": signs}, rout, finite


def _terngrad(lib, tf, codec, cols, g, residual, noise, gen):
    scale, codes, rout, finite = lib.hvdc_tern_grad_encode(g, residual, *_noise_inputs(tf, noise, gen),
                                                           clip=codec.clip)
    return {"scale": scale, "codes": codes}, rout, finite


def _qsgd(lib, tf, codec, cols, g, residual, noise, gen):
    norms, codes, rout, finite = lib.hvdc_qsgd_encode(g, residual, *_noise_inputs(tf, noise, gen),
                                                      levels=codec.s, bucket=codec.d)
    return {"norms": norms, "codes": codes}, rout, finite


for _cls, _op in ((ThresholdCodec, _threshold), (OneBitCodec, _onebit), (TernGradCodec, _terngrad),
                 (QSGDCodec, _qsgd)):
    register(_cls, _quantizer(_op))


# -- the sparsifiers (codec: the compressor; with a quantizer of the values: the chain) ---
def _topk(lib, comp):
    """Top-k's whole payload (``PayloadFastPath``): ``(g, residual, _, _) -> ({"payload"},
    new residual, finite)``; a non-finite step's values are NaN already."""
    import tensorflow as tf

    from ..core.bitpack import join_segments
    from ..core.sparsifiers import index_dtype

    def encode(g, residual, noise, noise_source):
        meta = comp.meta_for(g)
        itype = tf.int32 if index_dtype(meta.numel) == "int32" else tf.int64
        idx, values, rout, finite = lib.hvdc_topk_encode(
            g, _empty(tf) if residual is None else residual, k=comp.k_for(meta), index_type=itype)
        payload = join_segments(comp.B, comp.layout(meta), {"indices": idx, "values": values})
        return {"payload": payload}, (None if residual is None else rout), finite
    return encode


def _randomk(lib, comp):
    """Random-k's values at the core's indices: ``(g, residual, indices, scale) -> (values,
    new residual, finite)``; a non-finite step's values are NaN already."""
    import tensorflow as tf

    def encode(g, residual, idx, scale):
        values, rout, finite = lib.hvdc_randomk_encode(
            g, _empty(tf) if residual is None else residual, tf.cast(idx, tf.int64),
            _empty(tf) if scale is None else tf.cast(scale, tf.float32))
        return values, (None if residual is None else rout), finite
    return encode


def _dgc(lib, comp):
    """DGC's step for a sampled tensor: ``(g, state, meta, _) -> (payload, indices, valid,
    sent, (u, v, finite))`` (``DGC._encode_fused``); a non-finite step's values are NaN
    already."""
    import tensorflow as tf

    from ..core.bitpack import join_segments
    from ..core.sparsifiers import index_dtype

    def encode(g, st, meta, _):
        pos, want = comp.sample_plan(meta, st.step, like=g)
        p = comp.params
        idx, values, valid, u, v, finite = lib.hvdc_dgc_encode(
            g, st.u, st.v, tf.cast(pos, tf.int64), k=comp.k_for(meta), want=want,
            momentum=float(p["momentum"]), nesterov=bool(p["nesterov"]), masking=bool(p["masking"]))
        fields = {"indices": tf.cast(idx, tf.int32 if index_dtype(meta.numel) == "int32" else tf.int64),
                  "values": values}
        payload = join_segments(comp.B, comp.layout(meta), fields)
        return payload, idx, valid, values, (u, v, finite)
    return encode


def _sparsifier(make):
    """An encoder maker for a sparsifier: none with a quantizer of the values (the chain)."""
    return lambda lib, comp, cols: None if comp.codec is not None else make(lib, comp)


for _cls, _make in ((TopK, _topk), (RandomK, _randomk), (DGC, _dgc)):
    register(_cls, _sparsifier(_make))


def _stratified(lib, n: int, k: int, key0, key1):
    """:func:`~hvd_compress.core.sampling.stratified_indices`'s ``(indices, sizes)`` in one
    op (the chain is some fifteen TF ops over k elements)."""
    import tensorflow as tf
    return tuple(lib.hvdc_stratified(tf.cast(key0, tf.int64), tf.cast(key1, tf.int64), n=n, k=k))


register(Stratified, lambda lib, marker, cols: lambda n, k, key0, key1: _stratified(lib, n, k, key0, key1))


def scatter_add(acc, idx, values, n: int):
    """``acc`` (None: zeros) with float32 ``values`` added at ``idx`` in slot order (numpy's
    ``add.at``), a new length-``n`` tensor; or None without the ops."""
    lib = library()
    if lib is None:
        return None
    import tensorflow as tf
    if idx.dtype not in (tf.int32, tf.int64):
        idx = tf.cast(idx, tf.int64)
    return lib.hvdc_scatter_add(_empty(tf) if acc is None else acc, tf.reshape(idx, [-1]),
                                tf.reshape(tf.cast(values, tf.float32), [-1]), n=n)


def unpack(data, bits: int, n: int, values, factors=None, d=None, cols: int = 1):
    """``values[code i] * factors[i // d]`` for the ``n`` packed codes, or None without the ops;
    with ``cols`` > 1, ``values`` holds a value per code and column (code-major) of the
    ``n / cols`` x ``cols`` matrix."""
    lib = library()
    if lib is None:
        return None
    import tensorflow as tf
    table = tf.constant(values, tf.float32) if isinstance(values, list) else tf.cast(values, tf.float32)
    factors = _empty(tf) if factors is None else tf.reshape(factors, [-1])
    return lib.hvdc_unpack(data, table, factors, n=n, bits=bits, bucket=d or max(n, 1), cols=cols)


# -- PowerSGD's products (lowrank_ops.cc) --------------------------------------------------
#: the most columns a thin factor may have for the compiled products
MAX_RANK = 16


def lowrank():
    """The op module for the products with a thin factor -- ``hvdc_matmul(m, q)`` (M Q),
    ``hvdc_matmul_t(m, p)`` (M^T P), ``hvdc_low_rank(p, q)`` (P Q^T),
    ``hvdc_sub_low_rank(m, p, q)`` (M - P Q^T) -- and ``hvdc_all_finite(x)``, or None
    without the library."""
    return library()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Build (or find in the cache) the fused TensorFlow CPU ops "
                                             "of the quantizers and PowerSGD, load them and print the "
                                             "library's path.")
    ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        path = build(verbose=True)
        import tensorflow as tf
        tf.load_op_library(str(path))
    except Exception as exc:  # noqa: BLE001
        print(f"fused ops: {exc}", file=sys.stderr)
        return 1
    print(f"fused ops: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
