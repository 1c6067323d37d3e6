"""One tensor's line of a wrapper's exchange plan (``opt.plan()``, ``tape.plan(variables)``).

:class:`PlanRow` names what the rows hold; it reads like the dict it replaced
(``row["bytes"]``, ``dict(row)``: :class:`~hvd_compress.core.record.Record`), so code
written against the dicts keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass

from .record import Record

__all__ = ["PlanRow"]


@dataclass(eq=False)
class PlanRow(Record):
    """``compression``: the spec the tensor travels with once compression runs;
    ``compressed``: whether it is compressed now (the small-tensor rule and the start step
    may send it as it is); ``bytes``: its payload bytes per step now; ``exchange`` /
    ``why``: how it travels and why (``exchange="auto"``'s choice and its costs; empty
    before the first exchange)."""

    name: str
    shape: tuple
    dtype: str
    compression: str
    compressed: bool
    bytes: int
    exchange: str = ""
    why: str = ""
