"""Waiting for Horovod's PyTorch handles without taking the CPU from the transfer.

Horovod 0.28.1's ``hvd.synchronize`` waits in C++ by calling ``sched_yield`` in a loop
(``WaitAndClear`` in ``horovod/torch/mpi_ops_v2.cc``).  Where workers have a core each
that costs one core; where they share cores (several CPU workers a machine, the 2-core
CI machine's four) every waiting worker's main thread competes with the Horovod
background threads that move the bytes, its own and the other workers'.  On 2 cores, 4
workers, the transformer example's dense 549 KB allreduce took 382-1,622 ms a step with
Horovod's wait against 25-34 ms with this one (docs/results/adam-era.md, "Waiting").

:func:`wait` polls instead: ``sched_yield`` for the first :data:`SPIN_S` seconds (short
collectives keep their latency), then sleeps for :data:`NAP_SHARE` of the time waited so
far, at least :data:`MIN_NAP_S` and at most :data:`MAX_NAP_S`, so a wait ends at most
about 5% (and 1 ms) after its collective.  ``HVD_COMPRESS_WAIT=spin`` restores Horovod's
own wait.
"""

from __future__ import annotations

import os
import time

import horovod.torch as hvd

__all__ = ["wait", "SPIN_S", "NAP_SHARE", "MIN_NAP_S", "MAX_NAP_S"]

#: seconds of ``sched_yield`` polling before the first sleep
SPIN_S = 1e-4
#: a sleep's share of the time waited so far
NAP_SHARE = 0.05
#: the shortest and the longest sleep (seconds)
MIN_NAP_S = 5e-5
MAX_NAP_S = 1e-3


def spins() -> bool:
    """Whether ``HVD_COMPRESS_WAIT=spin`` asks for Horovod's own wait (read at each call, so
    a benchmark can compare both in one process)."""
    mode = os.environ.get("HVD_COMPRESS_WAIT", "nap").strip().lower()
    if mode not in ("nap", "spin"):
        raise ValueError(f"HVD_COMPRESS_WAIT={mode!r}: 'nap' (the default) or 'spin'")
    return mode == "spin"


def until_done(done, clock=time.perf_counter, nap=time.sleep, yield_=os.sched_yield) -> None:
    """Return once ``done()`` is true: polled with ``yield_`` for :data:`SPIN_S`, then with
    sleeps growing with the time waited (:data:`NAP_SHARE`, within :data:`MIN_NAP_S` ..
    :data:`MAX_NAP_S`)."""
    start = clock()
    while not done():
        waited = clock() - start
        if waited < SPIN_S:
            yield_()
        else:
            nap(min(MAX_NAP_S, max(MIN_NAP_S, NAP_SHARE * waited)))


def wait(handle):
    """``hvd.synchronize(handle)`` (its result, its errors), reached by :func:`until_done`
    rather than Horovod's spinning wait."""
    if not spins():
        until_done(lambda: hvd.poll(handle))
    return hvd.synchronize(handle)
