"""What one rank's exchanges cost: bytes sent, collectives started, milliseconds spent.

:class:`Stats` is a dataclass with one field per quantity; it also reads and writes
like the dict it replaces (``stats["bytes_sent"]``, ``stats.get(...)``, ``dict(stats)``,
iteration over the keys), so code that reads a wrapper's ``comm_stats`` / ``last_stats``
/ ``comm_totals`` that way keeps working.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = ["Stats", "new_stats"]


@dataclass(eq=False)
class Stats(Mapping):
    """One step's (or a run's) account.  ``bytes_sent``: the payloads this rank sends
    (every round); ``local_bytes``: what the hierarchical exchange moves inside the
    node, dense (:mod:`.hierarchy`; 0 otherwise)."""

    bytes_sent: int = 0
    encode_ms: float = 0.0
    comm_ms: float = 0.0
    decode_ms: float = 0.0
    collectives: int = 0
    local_bytes: int = 0

    def __getitem__(self, key: str):
        if key not in _KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value) -> None:
        if key not in _KEYS:
            raise KeyError(key)
        setattr(self, key, value)

    def __iter__(self):
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(_KEYS)

    def __contains__(self, key) -> bool:
        return key in _KEYS

    def __eq__(self, other) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self.items()) == dict(other.items())

    def add(self, other: Mapping) -> None:
        """Add ``other``'s counts and times to these (a run's totals)."""
        for key in _KEYS:
            setattr(self, key, getattr(self, key) + other[key])

    def copy(self) -> "Stats":
        return Stats(**dict(self.items()))


_KEYS = tuple(f.name for f in fields(Stats))


def new_stats() -> Stats:
    """An empty account (:class:`Stats`)."""
    return Stats()
