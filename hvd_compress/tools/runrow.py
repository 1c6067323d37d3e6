"""One run of a comparison and, once it ran, what it measured: a row of ``results.csv``.

:class:`RunRow` has one field per column (:data:`COLUMNS`, in the CSV's order).  A run
as :func:`hvd_compress.tools.plan.plan_runs` makes it holds the settings only
(:data:`~hvd_compress.tools.plan.RUN_KEYS`); :func:`hvd_compress.tools.run.execute`
adds what the example's ``--json`` summary measured; a row read back from results.csv
holds every value as its text.  It reads and writes like the dict it replaced --
``row["status"]``, ``row.get(...)``, ``dict(row)``, equality with a dict -- where a key
it does not hold is missing, as in the dict: a field not set reads as :data:`ABSENT`
(false), and keys outside the columns (a results.csv written by another version) are
kept in ``others``, so a row goes through results.csv unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["ABSENT", "COLUMNS", "RunRow"]


class _Absent:
    """A column a row does not hold (its dict had no such key)."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


@dataclass(eq=False, repr=False)
class RunRow(MutableMapping):
    """The columns, each :data:`ABSENT` until set; text in a row read back from results.csv."""

    # the examples' summary (hvd_compress.tools.runtools.SUMMARY_KEYS)
    framework: str = ABSENT
    example: str = ABSENT
    compression: str = ABSENT
    np: int = ABSENT
    steps: int = ABSENT
    images_per_sec: float = ABSENT
    images_per_sec_per_worker: float = ABSENT
    bytes_per_step: int = ABSENT
    compute_ms: float = ABSENT
    encode_ms: float | None = ABSENT  # None: the run did not measure it
    comm_ms: float | None = ABSENT
    decode_ms: float | None = ABSENT
    test_accuracy: float | None = ABSENT
    wall_s: float = ABSENT
    # what compare adds (new ones are appended, so that the older columns keep their places)
    bandwidth: str = ABSENT  # "uncapped" or a rate
    latency: str = ABSENT  # "" uncapped
    status: str = ABSENT  # "ok", or why not and where its log is
    step_ms: float = ABSENT
    collectives_per_step: float = ABSENT
    parameters: int = ABSENT
    log: str = ABSENT
    mode: str = ABSENT  # hvd_compress.tools.plan's modes
    target_accuracy: float | str = ABSENT  # "" without a target
    time_to_target_s: float | str = ABSENT  # "" where the run never reached it
    epochs_to_target: int | str = ABSENT
    best_accuracy: float | str = ABSENT
    curve: str = ABSENT  # the accuracy curve as one JSON cell
    nodes: int = ABSENT
    local_bytes_per_step: int = ABSENT
    hierarchical: str = ABSENT
    hosts: str = ABSENT  # --hosts: the hosts the ranks filled, "host:workers,..."; "" elsewhere
    link_bandwidth: str = ABSENT  # --hosts-bandwidth: the stated rate between those hosts
    exchange: str = ABSENT  # how compressed tensors travelled (the example's summary)
    wire_in_per_step: int = ABSENT  # bytes reaching a worker over its links (the account)
    wire_out_per_step: int = ABSENT
    device: str = ABSENT  # where the run trained: "cuda" or "cpu" (rows written before: cpu)
    # the language model's (hvd_compress.tools.plan.LOSS_EXAMPLES, OPTIMIZERS)
    optimizer: str = ABSENT  # "adamw", "onebit-adam", ...; "" for examples without a choice
    tokens_per_sec: float = ABSENT  # (images_per_sec holds the same: tokens are its samples)
    val_loss: float = ABSENT  # the validation loss at the end (nats a byte)
    best_loss: float | str = ABSENT  # the lowest validation loss of the curve
    target_loss: float | str = ABSENT  # "" without a --target-loss
    steps_to_target: int | str = ABSENT  # "" where the run never reached it
    # codec calls and compressed tensors a step (the account's), for the cost model
    encode_calls_per_step: float = ABSENT
    decode_calls_per_step: float = ABSENT
    tensors_per_step: float = ABSENT
    repeat: int = ABSENT  # --repeat: which of the run's repetitions (rows written before: 1)
    #: keys outside :data:`COLUMNS`, as they came
    others: dict = field(default_factory=dict)

    @classmethod
    def of(cls, row: Mapping) -> "RunRow":
        """``row`` as a RunRow: itself if it is one, else a new one with its items."""
        if isinstance(row, cls):
            return row
        out = cls()
        for key, value in row.items():
            out[key] = value
        return out

    def __getitem__(self, key):
        if key in _COLUMNS:
            value = getattr(self, key)
            if value is ABSENT:
                raise KeyError(key)
            return value
        return self.others[key]

    def __setitem__(self, key, value) -> None:
        if key in _COLUMNS:
            setattr(self, key, value)
        else:
            self.others[key] = value

    def __delitem__(self, key) -> None:
        if key in _COLUMNS:
            if getattr(self, key) is ABSENT:
                raise KeyError(key)
            setattr(self, key, ABSENT)
        else:
            del self.others[key]

    def __iter__(self):
        for key in COLUMNS:
            if getattr(self, key) is not ABSENT:
                yield key
        yield from self.others

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key) -> bool:
        if key in _COLUMNS:
            return getattr(self, key) is not ABSENT
        return key in self.others

    def __repr__(self) -> str:
        return f"RunRow({dict(self.items())!r})"

    def copy(self) -> "RunRow":
        return RunRow.of(dict(self.items()))


#: results.csv's columns, in order: the examples' summary keys, then what compare adds
COLUMNS = [f.name for f in fields(RunRow) if f.name != "others"]
_COLUMNS = frozenset(COLUMNS)
