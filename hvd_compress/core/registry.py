"""One entry per algorithm: its spec name, parameter schema, core class and class name.

Everything else is derived from here: :mod:`.spec` validates specs against the
schemas (in the table of :mod:`.table`, which this module fills), :func:`build`
makes the core compressor, the PyTorch and TensorFlow named classes
(``hc.TopK(ratio=0.01)``, ``hct.TopK(...)``) and :func:`.spec.describe` come from
the entries.  A new algorithm needs a core class and one :func:`register` call --
no framework code::

    register(Algorithm("mine", "Mine", MyCompressor, {"ratio": Param(float, 0.1)}))

Defaults follow each paper (see the core classes' docstrings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .backend import NUMPY
from .base import Compressor
from .dgc import DGC
from .intsum import IntegerSum
from .levels import EightBitCodec, NaturalCodec, SketchMLCodec, UniformCodec
from .powersgd import PowerSGD
from .quantizers import CODECS, Cast16, Identity, QuantizerCompressor
from .signs import EFSignCodec, SignCodec, SignCompressor, SignumCodec
from .sparsifiers import RandomK, TopK
from .spec import parse
from .table import Param, algorithms, defaults, get, register, unregister
from .variable import AdaptiveQuantization, Inceptionn, ThresholdV

CODECS.update({c.name: c for c in (SignCodec, EFSignCodec, SignumCodec, NaturalCodec, UniformCodec,
                                   EightBitCodec, SketchMLCodec)})

__all__ = ["Param", "Algorithm", "register", "unregister", "get", "algorithms", "defaults", "build",
           "core_of", "passes_through", "summable", "chains_rounds"]


def _in_open_closed(lo, hi):  # (lo, hi]
    return (lambda v: lo < v <= hi), f"in ({lo:g}, {hi:g}]"


def _in_closed_open(lo, hi):  # [lo, hi)
    return (lambda v: lo <= v < hi), f"in [{lo:g}, {hi:g})"


def _in_closed(lo, hi):  # [lo, hi]
    return (lambda v: lo <= v <= hi), f"in [{lo:g}, {hi:g}]"


def _at_least(lo):
    return (lambda v: v >= lo), f">= {lo:g}"


def _positive():
    return (lambda v: v > 0), "> 0"


@dataclass(frozen=True)
class Algorithm:
    """A compressor the suite knows.

    ``core(params, backend=, rank=, world_size=, **args)`` makes it (``args`` fixed
    per entry, e.g. the codec of a quantizer); ``role``: ``"sparsifier"`` (may be
    followed by a quantizer of the kept values, ``topk+qsgd``), ``"quantizer"``
    (may follow one) or ``""``; ``derive(params)`` fills parameters whose default
    depends on others."""

    name: str
    class_name: str
    core: type
    params: dict = field(default_factory=dict)
    role: str = ""
    args: dict = field(default_factory=dict)
    derive: Callable[[dict], None] | None = None
    doc: str = ""

    @property
    def summable(self) -> bool:
        """Whether payloads add up (allreduce; usable in Horovod's own wrappers) at the
        default parameters.  Some answers depend on the parameters (DGC's ``dense``, the
        quantizer after Random-k, ``sum=int``): :func:`summable` answers for a spec."""
        return summable(self.name)

    def make(self, params: dict, backend=NUMPY, rank: int = 0, world_size: int = 1,
             **extra) -> Compressor:
        if params.get("sum") == "int":  # codes summed by allreduce (:mod:`.intsum`)
            return IntegerSum(params=params, backend=backend, rank=rank, world_size=world_size,
                              kind=self.name)
        return self.core(params=params, backend=backend, rank=rank, world_size=world_size,
                         **self.args, **extra)


def build(spec, backend=NUMPY, rank: int = 0, world_size: int = 1) -> Compressor:
    """A fresh compressor (with empty state) for ``spec`` on ``backend``.

    ``rank`` seeds this rank's own stochastic-rounding noise; ``world_size``
    scales DGC's local clipping and PowerSGD's warm start.
    """
    parsed = parse(spec)
    first = parsed.parts[0]
    extra = {}
    if parsed.composed:
        second = parsed.parts[1]
        extra["codec"] = (second.name, second.params)
    comp = get(first.name).make(first.params, backend, rank, world_size, **extra)
    comp.spec = parsed
    return comp


def _core_of_part(part) -> type:
    return IntegerSum if part.params.get("sum") == "int" else get(part.name).core


def core_of(spec) -> type:
    """The core class ``spec`` builds (a composition's: its sparsifier's), whose class
    flags (``passthrough``, ``owns_momentum``, ...) say what it needs, without building it."""
    return _core_of_part(parse(spec).parts[0])


def passes_through(spec) -> bool:
    """Whether ``spec`` sends tensors as they are, averaged as Horovod does (``none``)."""
    parsed = parse(spec)
    return not parsed.composed and bool(core_of(parsed).passthrough)


def chains_rounds(spec) -> bool:
    """Whether an exchange of ``spec`` computes a round from an earlier one's sum and starts
    the next step from it (``chained_rounds``: PowerSGD), so that it cannot be left in
    flight across steps."""
    return any(_core_of_part(part).chained_rounds for part in parse(spec).parts)


def summable(spec) -> bool:
    """Whether ``spec``'s payloads add up (allreduce).  A class cannot always say: Random-k
    sums its values unless a quantizer's codes follow, DGC only with ``dense=true``, so
    the answer is read from a fresh compressor (nothing is encoded)."""
    return bool(build(spec).summable)


def _randomk_ef(params: dict) -> None:
    if params["ef"] is None:
        params["ef"] = not params["unbiased"]


_SEED = Param(int, 0, _at_least(0), "seed of the compressor's own random streams")
_VOTE = Param(bool, True, None, "majority vote sign(sum of signs) (false: the mean of signs)")
_SUM = Param(str, "gather", ((lambda v: v in ("gather", "int")), "gather or int"),
             "how ranks combine: gather (packed codes by allgather) or int (codes against a "
             "scale shared by a max allreduce, summed as integers by one allreduce)")
_RATIO = Param(float, 0.01, _in_open_closed(0, 1), "fraction k/n of elements kept")

for _alg in (
    Algorithm("none", "NoneCompressor", Identity, doc="No compression (32 bits, allreduce)."),
    Algorithm("fp16", "FP16", Cast16, role="quantizer", args={"name": "fp16"},
              doc="Cast to float16 for the allreduce (as Horovod's Compression.fp16)."),
    Algorithm("bf16", "BF16", Cast16, role="quantizer", args={"name": "bf16"},
              doc="Round to bfloat16; sent as float16 since Horovod cannot allreduce bfloat16."),
    Algorithm("topk", "TopK", TopK, role="sparsifier", params={
        "ratio": _RATIO,
        "ef": Param(bool, True, None, "error feedback"),
    }, doc="Top-k sparsification with error feedback (Aji & Heafield 2017)."),
    Algorithm("randomk", "RandomK", RandomK, role="sparsifier", params={
        "ratio": _RATIO,
        "unbiased": Param(bool, False, None, "scale kept values by n/k (unbiased estimate)"),
        "ef": Param(bool, None, None, "error feedback (default: on unless unbiased)"),
        "seed": _SEED,
    }, derive=_randomk_ef,
        doc="Random-k with indices shared by all ranks (Stich et al. 2018); allreduce."),
    Algorithm("dgc", "DGC", DGC, role="sparsifier", params={
        "ratio": Param(float, 0.001, _in_open_closed(0, 1), "final fraction of elements sent"),
        "momentum": Param(float, 0.9, _in_closed_open(0, 1), "momentum kept in the compressor"),
        "nesterov": Param(bool, False, None, "Nesterov momentum correction"),
        "sample_ratio": Param(float, 0.01, _in_open_closed(0, 1),
                              "fraction sampled to estimate the threshold"),
        "warmup_epochs": Param(int, 4, _at_least(0), "epochs of exponential warm-up sparsity"),
        "warmup_coeff": Param(float, 0.0, _in_closed(0, 1),
                              "density factor per warm-up epoch (0: ratio^(1/(warmup_epochs+1)); "
                              "1: dense momentum SGD through the warm-up, the authors' wm5o)"),
        "masking": Param(bool, True, None, "momentum factor masking (zero u where sent)"),
        "compress_1d": Param(bool, False, None,
                             "sparsify tensors of fewer than 2 dimensions too (default: sent "
                             "whole, with momentum, as the authors do)"),
        "dense": Param(bool, False, None,
                       "send every tensor whole with momentum, summed by allreduce (what the "
                       "per-tensor policy's uncompressed tensors of a DGC plan travel with)"),
        "steps_per_epoch": Param(int, 0, _at_least(0),
                                 "steps per epoch for the warm-up (0: use set_epoch())"),
        "clip_norm": Param(float, 0.0, _at_least(0),
                           "local gradient clipping norm before N^-1/2 scaling (0: off)"),
        "seed": _SEED,
    }, doc="Deep Gradient Compression (Lin et al. 2018); pair with SGD without momentum."),
    Algorithm("qsgd", "QSGD", QuantizerCompressor, role="quantizer", args={"codec_name": "qsgd"},
              params={
        "levels": Param(int, 7, _at_least(1), "quantization levels s per sign"),
        "bucket": Param(int, 512, _at_least(1), "elements per bucket sharing one norm"),
        "ef": Param(bool, False, None, "error feedback (QSGD is unbiased: off)"),
        "seed": _SEED,
        "sum": _SUM,
    }, doc="QSGD stochastic quantization (Alistarh et al. 2017), unbiased."),
    Algorithm("terngrad", "TernGrad", QuantizerCompressor, role="quantizer",
              args={"codec_name": "terngrad"}, params={
        "clip": Param(float, 2.5, _at_least(0), "clip at clip*sigma before scaling (0: off)"),
        "ef": Param(bool, False, None, "error feedback (TernGrad is unbiased: off)"),
        "seed": _SEED,
        "sum": _SUM,
    }, doc="TernGrad (Wen et al. 2017), unbiased ternary quantization."),
    Algorithm("onebit", "OneBit", QuantizerCompressor, role="quantizer",
              args={"codec_name": "onebit"}, params={
        "ef": Param(bool, True, None, "error feedback (1-bit SGD needs it)"),
    }, doc="1-bit SGD with error feedback (Seide et al. 2014)."),
    Algorithm("threshold", "Threshold", QuantizerCompressor, role="quantizer",
              args={"codec_name": "threshold"}, params={
        "tau": Param(float, 0.01, _positive(), "threshold; values sent as +tau, -tau or 0"),
        "ef": Param(bool, True, None, "residual kept (Strom 2015)"),
    }, doc="2-bit threshold quantization with residual (Strom 2015)."),
    Algorithm("signsgd", "SignSGD", SignCompressor, args={"codec_name": "signsgd", "name": "signsgd"},
              params={"vote": _VOTE, "sum": _SUM},
              doc="signSGD with majority vote (Bernstein et al. 2018, 2019): 1 bit per element."),
    Algorithm("signum", "Signum", SignCompressor, args={"codec_name": "signum", "name": "signum"},
              params={
        "momentum": Param(float, 0.9, _in_closed_open(0, 1), "momentum beta kept in the compressor"),
        "vote": _VOTE,
    }, doc="Signum (Bernstein et al. 2018): the sign of a momentum, majority vote; pair with "
           "SGD without momentum."),
    Algorithm("efsignsgd", "EFSignSGD", QuantizerCompressor, role="quantizer",
              args={"codec_name": "efsignsgd"}, params={
        "ef": Param(bool, True, None, "error feedback (the method's point: nothing lost)"),
    }, doc="EF-signSGD (Karimireddy et al. 2019): ||v||_1/n * sign(v) with error feedback."),
    Algorithm("natural", "Natural", QuantizerCompressor, role="quantizer",
              args={"codec_name": "natural"}, params={
        "ef": Param(bool, False, None, "error feedback (natural compression is unbiased: off)"),
        "seed": _SEED,
    }, doc="Natural compression (Horvath et al. 2019): unbiased rounding to a power of two, "
           "9 bits."),
    Algorithm("uniform", "Uniform", QuantizerCompressor, role="quantizer",
              args={"codec_name": "uniform"}, params={
        "bits": Param(int, 4, ((lambda v: 1 <= v <= 8), "in [1, 8]"), "bits per element"),
        "bucket": Param(int, 512, _at_least(1), "elements per bucket sharing one min and scale"),
        "stochastic": Param(bool, True, None,
                            "stochastic rounding (unbiased); false: the nearest level"),
        "ef": Param(bool, False, None, "error feedback"),
        "seed": _SEED,
    }, doc="Uniform max-min quantization in buckets (CGX; Bagua ByteGrad)."),
    Algorithm("eightbit", "EightBit", QuantizerCompressor, role="quantizer",
              args={"codec_name": "eightbit"}, params={
        "ef": Param(bool, False, None, "error feedback"),
    }, doc="8-bit approximation, the dynamic tree type (Dettmers 2016)."),
    Algorithm("sketchml", "SketchML", QuantizerCompressor, role="quantizer",
              args={"codec_name": "sketchml"}, params={
        "buckets": Param(int, 256, ((lambda v: 2 <= v <= 32768), "in [2, 32768]"),
                         "quantile buckets q (codes of 8 bits up to 256, else 16)"),
        "sample": Param(int, 65536, _at_least(2), "values sampled for the quantiles"),
        "ef": Param(bool, False, None, "error feedback"),
    }, doc="SketchML (Jiang et al. 2018): quantile buckets, a bucket index per value and "
           "a mean per bucket."),
    Algorithm("thresholdv", "ThresholdV", ThresholdV, params={
        "tau": Param(float, 0.01, _positive(), "values with |v| > tau are sent, with their indices"),
        "ef": Param(bool, True, None, "error feedback (the rest stays in the residual)"),
    }, doc="Threshold-v: every value above tau with its index (variable size; Strom 2015, GRACE)."),
    Algorithm("adaq", "AdaptiveQuantization", AdaptiveQuantization, params={
        "ratio": _RATIO,
        "ef": Param(bool, True, None, "error feedback (the rest and the error stay behind)"),
    }, doc="Adaptive quantization (Dryden et al. 2016): the largest of each sign as indices "
           "plus one mean per sign (variable size)."),
    Algorithm("inceptionn", "Inceptionn", Inceptionn, params={
        "bound": Param(float, 2.0 ** -10, _positive(), "the most any value may change"),
        "ef": Param(bool, False, None, "error feedback (the error is bounded: off)"),
    }, doc="INCEPTIONN (Li et al. 2018): error-bounded values in 0, 8, 16 or 32 bits "
           "(variable size)."),
    Algorithm("powersgd", "PowerSGD", PowerSGD, params={
        "rank": Param(int, 2, _at_least(1), "rank r of the approximation"),
        "ef": Param(bool, True, None, "error feedback"),
        "warm_start": Param(bool, True, None, "reuse last step's Q"),
        "seed": _SEED,
    }, doc="PowerSGD low-rank compression (Vogels et al. 2019); two allreduce rounds."),
):
    register(_alg)
del _alg
