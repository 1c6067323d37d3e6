"""Compressor specs: ``"topk:ratio=0.01+qsgd:levels=16"`` -> validated config.

Grammar::

    spec      := part ("+" part)*
    part      := name [":" key "=" value ("," key "=" value)*]

A single part names one compressor; two parts compose a *sparsifier*
(``topk``, ``randomk``, ``dgc``) with a *quantizer* of the kept values
(``fp16``, ``bf16``, ``qsgd``, ``terngrad``, ``onebit``, ``threshold``).
Every parameter has a default taken from the compressor's paper; a bad spec
raises :class:`ValueError` naming the part and what is allowed.

``ef`` (error feedback) defaults to on for biased compressors and off for the
unbiased ones (QSGD, TernGrad, unbiased Random-k); it can be switched either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["CompressorSpec", "Spec", "parse", "NAMES", "SPARSIFIERS", "QUANTIZERS"]


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false/1/0), got {text!r}")


def _in_open_closed(lo, hi):  # (lo, hi]
    return (lambda v: lo < v <= hi), f"in ({lo:g}, {hi:g}]"


def _in_closed_open(lo, hi):  # [lo, hi)
    return (lambda v: lo <= v < hi), f"in [{lo:g}, {hi:g})"


def _at_least(lo):
    return (lambda v: v >= lo), f">= {lo:g}"


def _positive():
    return (lambda v: v > 0), "> 0"


@dataclass(frozen=True)
class _Param:
    kind: Callable[[str], Any]
    default: Any
    check: tuple | None = None  # (predicate, description)
    doc: str = ""


_ANY_INT = None
_SEED = _Param(int, 0, _at_least(0), "seed of the compressor's own random streams")

# name -> {param: _Param}; defaults follow each paper (see hvd_compress/core).
_PARAMS: dict[str, dict[str, _Param]] = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "topk": {
        "ratio": _Param(float, 0.01, _in_open_closed(0, 1), "fraction k/n of elements kept"),
        "ef": _Param(_bool, True, None, "error feedback"),
    },
    "randomk": {
        "ratio": _Param(float, 0.01, _in_open_closed(0, 1), "fraction k/n of elements kept"),
        "unbiased": _Param(_bool, False, None, "scale kept values by n/k (unbiased estimate)"),
        "ef": _Param(_bool, None, None, "error feedback (default: on unless unbiased)"),
        "seed": _SEED,
    },
    "dgc": {
        "ratio": _Param(float, 0.001, _in_open_closed(0, 1), "final fraction of elements sent"),
        "momentum": _Param(float, 0.9, _in_closed_open(0, 1), "momentum kept in the compressor"),
        "nesterov": _Param(_bool, False, None, "Nesterov momentum correction"),
        "sample_ratio": _Param(float, 0.01, _in_open_closed(0, 1),
                               "fraction sampled to estimate the threshold"),
        "warmup_epochs": _Param(int, 4, _at_least(0), "epochs of exponential warm-up sparsity"),
        "steps_per_epoch": _Param(int, 0, _at_least(0),
                                  "steps per epoch for the warm-up (0: use set_epoch())"),
        "clip_norm": _Param(float, 0.0, _at_least(0),
                            "local gradient clipping norm before N^-1/2 scaling (0: off)"),
        "seed": _SEED,
    },
    "qsgd": {
        "levels": _Param(int, 7, _at_least(1), "quantization levels s per sign"),
        "bucket": _Param(int, 512, _at_least(1), "elements per bucket sharing one norm"),
        "ef": _Param(_bool, False, None, "error feedback (QSGD is unbiased: off)"),
        "seed": _SEED,
    },
    "terngrad": {
        "clip": _Param(float, 2.5, _at_least(0), "clip at clip*sigma before scaling (0: off)"),
        "ef": _Param(_bool, False, None, "error feedback (TernGrad is unbiased: off)"),
        "seed": _SEED,
    },
    "onebit": {
        "ef": _Param(_bool, True, None, "error feedback (1-bit SGD needs it)"),
    },
    "threshold": {
        "tau": _Param(float, 0.01, _positive(), "threshold; values sent as +tau, -tau or 0"),
        "ef": _Param(_bool, True, None, "residual kept (Strom 2015)"),
    },
    "powersgd": {
        "rank": _Param(int, 2, _at_least(1), "rank r of the approximation"),
        "ef": _Param(_bool, True, None, "error feedback"),
        "warm_start": _Param(_bool, True, None, "reuse last step's Q"),
        "seed": _SEED,
    },
}

NAMES = tuple(_PARAMS)
SPARSIFIERS = ("topk", "randomk", "dgc")
QUANTIZERS = ("fp16", "bf16", "qsgd", "terngrad", "onebit", "threshold")


@dataclass(frozen=True)
class CompressorSpec:
    """One validated part: a compressor name and its complete parameters."""

    name: str
    params: dict = field(default_factory=dict)

    def __str__(self) -> str:
        given = [f"{k}={_fmt(v)}" for k, v in self.params.items()]
        return self.name + (":" + ",".join(given) if given else "")


@dataclass(frozen=True)
class Spec:
    """A whole spec: one part, or a sparsifier followed by a quantizer."""

    parts: tuple

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self.parts)

    @property
    def composed(self) -> bool:
        return len(self.parts) > 1

    def __str__(self) -> str:
        return "+".join(str(p) for p in self.parts)


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _parse_part(text: str) -> CompressorSpec:
    text = text.strip()
    name, _, args = text.partition(":")
    name = name.strip().lower()
    if name not in _PARAMS:
        raise ValueError(f"unknown compressor {name!r} in spec part {text!r}; "
                         f"known: {', '.join(NAMES)}")
    schema = _PARAMS[name]
    given: dict[str, str] = {}
    if args.strip():
        for item in args.split(","):
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if not eq or not key or not value.strip():
                raise ValueError(f"{name}: expected key=value, got {item.strip()!r}")
            if key not in schema:
                allowed = ", ".join(schema) or "none"
                raise ValueError(f"{name}: unknown parameter {key!r}; allowed: {allowed}")
            if key in given:
                raise ValueError(f"{name}: parameter {key!r} given twice")
            given[key] = value.strip()
    params = {}
    for key, p in schema.items():
        if key in given:
            try:
                value = p.kind(given[key])
            except ValueError as exc:
                kind = {int: "an integer", float: "a number"}.get(p.kind, "a boolean")
                raise ValueError(f"{name}: {key} must be {kind}, got {given[key]!r}") from exc
            if p.check is not None and not p.check[0](value):
                raise ValueError(f"{name}: {key} must be {p.check[1]}, got {given[key]}")
        else:
            value = p.default
        params[key] = value
    if name == "randomk" and params["ef"] is None:
        params["ef"] = not params["unbiased"]
    return CompressorSpec(name, params)


def parse(spec) -> Spec:
    """Parse and validate ``spec`` (a string, a :class:`Spec` or a :class:`CompressorSpec`)."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, CompressorSpec):
        return Spec((spec,))
    if not isinstance(spec, str):
        raise TypeError(f"a compressor spec is a string like 'topk:ratio=0.01', got {type(spec).__name__}")
    if not spec.strip():
        raise ValueError(f"empty compressor spec; known: {', '.join(NAMES)}")
    parts = tuple(_parse_part(p) for p in spec.split("+"))
    if len(parts) > 2:
        raise ValueError(f"{spec!r}: a composition has two parts, a sparsifier "
                         f"({', '.join(SPARSIFIERS)}) then a quantizer ({', '.join(QUANTIZERS)})")
    if len(parts) == 2:
        first, second = parts
        if first.name not in SPARSIFIERS:
            raise ValueError(f"{spec!r}: the first part of a composition must be a sparsifier "
                             f"({', '.join(SPARSIFIERS)}), got {first.name!r}")
        if second.name not in QUANTIZERS:
            raise ValueError(f"{spec!r}: the second part of a composition must be a quantizer "
                             f"({', '.join(QUANTIZERS)}), got {second.name!r}")
    return Spec(parts)


def describe() -> str:
    """Human-readable table of every compressor's parameters and defaults."""
    lines = []
    for name, schema in _PARAMS.items():
        if not schema:
            lines.append(f"{name}")
        for key, p in schema.items():
            rule = f" ({p.check[1]})" if p.check else ""
            lines.append(f"{name}:{key}={_fmt(p.default) if p.default is not None else 'auto'}"
                         f"{rule}  {p.doc}")
    return "\n".join(lines)
