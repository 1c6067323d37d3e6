"""Several worker bodies in one launch: ``tests.harness.run_many`` launches :func:`run`.

Launching costs seconds (the launcher, importing a framework, ``hvd.init``), so a test
module whose cases each need a launch of the same kind runs them all in one, one after
another in the same processes, and its tests read their case's results."""

from __future__ import annotations

import os
import time

from .entry import resolve


def run(calls):
    """Call each ``[key, "module:function", kwargs]`` in order; returns ``{key: result}``.
    ``HVD_TEST_BODY_TIMES=PATH``: each body's seconds appended there (where a shared
    launch's time goes)."""
    results = {}
    timed = os.environ.get("HVD_TEST_BODY_TIMES")
    for key, target, kwargs in calls:
        t0 = time.perf_counter()
        results[key] = resolve(target)(**kwargs)
        if timed:
            with open(timed, "a") as f:
                f.write(f"{time.perf_counter() - t0:7.2f} s {key} (pid {os.getpid()})\n")
    return results
