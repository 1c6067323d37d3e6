"""What one rank's exchanges cost: bytes sent, collectives started, milliseconds spent.

:class:`Stats` is a dataclass with one field per quantity; it also reads and writes
like the dict it replaces (``stats["bytes_sent"]``, ``stats.get(...)``, ``dict(stats)``,
iteration over the keys: :class:`~.record.Record`), so code that reads a wrapper's
``comm_stats`` / ``last_stats`` / ``comm_totals`` that way keeps working.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .record import Record

__all__ = ["Stats", "new_stats"]


@dataclass(eq=False)
class Stats(Record):
    """One step's (or a run's) account.  ``bytes_sent``: the payloads this rank sends
    (every round); ``local_bytes``: what the hierarchical exchange moves inside the
    node, dense (:mod:`.hierarchy`; 0 otherwise).  ``wire_out`` / ``wire_in``: the bytes
    that leave and reach this rank over its links (between nodes, where hierarchical), by
    collective: an allreduce of ``S`` bytes ``2 (p-1) S // p`` each way (ring); an
    allgather of rows ``c_0 .. c_{p-1}`` out ``(p-1) c_r``, in the others' rows; an
    alltoall out the rows for the others, in the rows from them.  ``encode_calls`` /
    ``decode_calls``: the codec's calls (a tensor or chunk encoded; a payload decoded;
    tensors that travel uncompressed not counted), each of which has a fixed cost besides
    its values' (Python, a kernel launch): the two-phase exchange makes ``p + 1`` and
    ``2 p`` a tensor, or a backend's chunk path 2 and 2.  ``tensors``: the compressed
    tensors exchanged (the cost model scales what each costs a worker with the workers)."""

    bytes_sent: int = 0
    encode_ms: float = 0.0
    comm_ms: float = 0.0
    decode_ms: float = 0.0
    collectives: int = 0
    local_bytes: int = 0
    wire_out: int = 0
    wire_in: int = 0
    encode_calls: int = 0
    decode_calls: int = 0
    tensors: int = 0

    def add(self, other: Mapping) -> None:
        """Add ``other``'s counts and times to these (a run's totals)."""
        for key in self.keys_of():
            setattr(self, key, getattr(self, key) + other[key])


def new_stats() -> Stats:
    """An empty account (:class:`Stats`)."""
    return Stats()
