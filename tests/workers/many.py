"""Several worker bodies in one launch: ``tests.harness.run_many`` launches :func:`run`.

Launching costs seconds (the launcher, importing a framework, ``hvd.init``), so a test
module whose cases each need a launch of the same kind runs them all in one, one after
another in the same processes, and its tests read their case's results."""

from __future__ import annotations

from .entry import resolve


def run(calls):
    """Call each ``[key, "module:function", kwargs]`` in order; returns ``{key: result}``."""
    results = {}
    for key, target, kwargs in calls:
        results[key] = resolve(target)(**kwargs)
    return results
