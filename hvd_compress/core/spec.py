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

The grammar reads the compressors and their schemas from :mod:`.table`, which
:mod:`.registry` fills when the core is imported; ``hvd_compress.spec`` is this
module under its public name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import table

__all__ = ["CompressorSpec", "Spec", "parse", "describe"]  # and NAMES, SPARSIFIERS, QUANTIZERS


def __getattr__(name):
    """``NAMES``, ``SPARSIFIERS``, ``QUANTIZERS``: read from the table when asked, so
    that compressors registered later are included."""
    algs = table.algorithms()
    if name == "NAMES":
        return tuple(a.name for a in algs)
    if name == "SPARSIFIERS":
        return tuple(a.name for a in algs if a.role == "sparsifier")
    if name == "QUANTIZERS":
        return tuple(a.name for a in algs if a.role == "quantizer")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    known = {a.name: a for a in table.algorithms()}
    if name not in known:
        raise ValueError(f"unknown compressor {name!r} in spec part {text!r}; "
                         f"known: {', '.join(known)}")
    alg = known[name]
    schema = alg.params
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
                value = p.read(given[key])
            except ValueError as exc:
                kind = {int: "an integer", float: "a number", str: "text"}.get(p.kind, "a boolean")
                raise ValueError(f"{name}: {key} must be {kind}, got {given[key]!r}") from exc
            if p.check is not None and not p.check[0](value):
                raise ValueError(f"{name}: {key} must be {p.check[1]}, got {given[key]}")
        else:
            value = p.default
        params[key] = value
    if alg.derive is not None:
        alg.derive(params)
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
        raise ValueError(f"empty compressor spec; known: {', '.join(__getattr__('NAMES'))}")
    parts = tuple(_parse_part(p) for p in spec.split("+"))
    sparsifiers, quantizers = __getattr__("SPARSIFIERS"), __getattr__("QUANTIZERS")
    if len(parts) > 2:
        raise ValueError(f"{spec!r}: a composition has two parts, a sparsifier "
                         f"({', '.join(sparsifiers)}) then a quantizer ({', '.join(quantizers)})")
    if len(parts) == 2:
        first, second = parts
        if first.name not in sparsifiers:
            raise ValueError(f"{spec!r}: the first part of a composition must be a sparsifier "
                             f"({', '.join(sparsifiers)}), got {first.name!r}")
        if second.name not in quantizers:
            raise ValueError(f"{spec!r}: the second part of a composition must be a quantizer "
                             f"({', '.join(quantizers)}), got {second.name!r}")
        if second.params.get("sum") == "int":
            raise ValueError(f"{spec!r}: sum=int sums a whole tensor's codes; the values a "
                             "sparsifier keeps differ by rank, so a composition gathers them")
    return Spec(parts)


def describe() -> str:
    """Human-readable table of every compressor's parameters and defaults."""
    lines = []
    for alg in table.algorithms():
        name, schema = alg.name, alg.params
        if not schema:
            lines.append(f"{name}")
        for key, p in schema.items():
            rule = f" ({p.check[1]})" if p.check else ""
            lines.append(f"{name}:{key}={_fmt(p.default) if p.default is not None else 'auto'}"
                         f"{rule}  {p.doc}")
    return "\n".join(lines)
