"""A matrix run more than once (``hvd-compress-compare --repeat N``): each run's
repetitions as one row of medians, for the tables, the plots and the cost model.

Runs of several workers on shared cores vary from run to run (the same forward and
backward pass took 122-176 ms on 2 shared cores); one run's times then move a fitted
model and its predictions by as much.  The median of a few repetitions, taken column by
column, is what one run would show without its worst luck.  results.csv keeps every
repetition.
"""

from __future__ import annotations

import statistics

from .plan import RUN_KEYS, repeat_of, run_key
from .report import number, ok_rows
from .runrow import RunRow

__all__ = ["TIMED", "medians"]

#: the columns whose median over the repetitions a row shows (times and rates, and what a
#: run that trains to a target measured on the way); every other column is the run's whose
#: step time is the median (its bytes, its curve)
TIMED = ("images_per_sec", "images_per_sec_per_worker", "compute_ms", "encode_ms", "comm_ms",
         "decode_ms", "step_ms", "wall_s", "tokens_per_sec", "time_to_target_s", "test_accuracy",
         "best_accuracy", "val_loss", "best_loss")
_REPEAT = RUN_KEYS.index("repeat")


def _config(row: dict) -> tuple:
    key = run_key(row)
    return key[:_REPEAT] + key[_REPEAT + 1:]


def medians(rows: list[dict]) -> list[RunRow]:
    """``rows`` with each configuration's successful repetitions made one row, in the order
    of its first: the repetition whose ``step_ms`` is the median (the lower one of an even
    count), its :data:`TIMED` columns the medians of the repetitions' where every one has a
    number (of an even count, the mean of the middle two), and ``repeats`` (a key outside
    the columns) how many there were.  A configuration without a successful repetition
    keeps its rows; a row alone is itself."""
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault(_config(r), []).append(r)
    out = []
    for group in groups.values():
        ok = ok_rows(group)
        if not ok:
            out.extend(RunRow.of(r) for r in group)
            continue
        if len(ok) == 1:
            out.append(RunRow.of(ok[0]))
            continue
        ok.sort(key=lambda r: (number(r, "step_ms") is None, number(r, "step_ms") or 0.0,
                               repeat_of(r)))
        row = RunRow.of(dict(ok[(len(ok) - 1) // 2].items()))
        for col in TIMED:
            values = [number(r, col) for r in ok]
            if all(v is not None for v in values):
                row[col] = statistics.median(values)
        row["repeats"] = len(ok)
        out.append(row)
    return out
