"""The table of known compressors, by spec name, and each one's parameter schema.

The lowest floor of the catalogue: :mod:`.registry` fills the table with its
entries, :mod:`.spec` validates specs against it and the codecs read their
defaults from it (:func:`defaults`), so none of them needs another's module.
The entries themselves (:class:`~.registry.Algorithm`) are read by attribute only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .base import Compressor

__all__ = ["Param", "register", "unregister", "get", "algorithms", "defaults"]


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false/1/0), got {text!r}")


@dataclass(frozen=True)
class Param:
    """One parameter: how its text is read (``int``, ``float``, ``bool``), its default
    (None: derived from the others by the entry's ``derive``), a check
    ``(predicate, description)`` and a line of documentation."""

    kind: Callable[[str], Any]
    default: Any
    check: tuple | None = None
    doc: str = ""

    def read(self, text: str):
        return _bool(text) if self.kind is bool else self.kind(text)


_REGISTRY: dict = {}


def register(algorithm, replace: bool = False):
    """Add ``algorithm`` (its spec name must be new unless ``replace``)."""
    name = algorithm.name
    if not name or not name.replace("_", "").isalnum() or name != name.lower():
        raise ValueError(f"a compressor name is lower-case letters, digits and '_', got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"compressor {name!r} is registered already")
    if not issubclass(algorithm.core, Compressor):
        raise TypeError(f"{name}: core must be a hvd_compress.core.Compressor subclass")
    _REGISTRY[name] = algorithm
    return algorithm


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str):
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(_REGISTRY)}") from None


def algorithms() -> tuple:
    """Every registered algorithm, in registration order."""
    return tuple(_REGISTRY.values())


def defaults(name: str) -> dict:
    """Every parameter of ``name`` at its default (the complete params a core class takes)."""
    alg = get(name)
    params = {k: p.default for k, p in alg.params.items()}
    if alg.derive is not None:
        alg.derive(params)
    return params
