"""Start a job's worker processes on this machine and wait for them: each with its own
environment (and command prefix), their output lines prefixed with their index as
``horovodrun`` prefixes them, the others stopped when one fails, all of them on a
time-out.  The launchers of TensorFlow's MultiWorkerMirroredStrategy (:mod:`.mwms`) and
of simulated nodes (:mod:`.nodesrun`) start their workers here; the capped links'
launchers (:mod:`.netcap`) and the comparison's launches (:mod:`.run`) wait for and stop
theirs with :func:`wait_all` and :func:`stop`."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time

from .stopping import kill_tree

__all__ = ["run_workers", "wait_all", "stop", "usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a container's
    cpuset), not ``os.cpu_count()``, which counts the whole machine -- workers sharing
    the cores they are given must not each start a thread per core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _relay(stream, index: int, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[{index}]<stdout>:{line}")
        out.flush()


def run_workers(command: list[str], envs: list[dict], name: str, timeout: float | None = None,
                prefix=None, out=None) -> int:
    """Run ``command`` once per entry of ``envs`` (each added to this process's
    environment); the first non-zero exit status (the others are stopped), 124 on a
    time-out, else 0.  ``prefix(i)``: what worker ``i``'s command line starts with;
    ``out``: where their output goes (stdout); ``name``: the launcher, in its messages."""
    out = sys.stdout if out is None else out
    procs, relays = [], []
    try:
        for i, extra in enumerate(envs):
            wenv = dict(os.environ)
            wenv.update(extra)
            p = subprocess.Popen((prefix(i) if prefix else []) + list(command), env=wenv,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_relay, args=(p.stdout, i, out), daemon=True)
            t.start()
            relays.append(t)
        rc = wait_all(procs, math.inf if timeout is None else timeout)
        if rc == 124:
            print(f"{name}: timed out after {timeout:.0f}s; every worker stopped", file=sys.stderr,
                  flush=True)
        elif rc:
            print(f"{name}: a worker exited with status {rc}; the others were stopped",
                  file=sys.stderr, flush=True)
        return rc if rc >= 0 else 1
    finally:
        for p in procs:
            stop(p)
        for t in relays:
            t.join(timeout=5)


def wait_all(procs: list, timeout_s: float) -> int:
    """Wait for every process; the first non-zero exit code, 124 on time-out, else 0.
    After one fails the others get 10 s to report before the caller stops them."""
    deadline = time.monotonic() + timeout_s
    first_bad = 0
    while True:
        codes = [p.poll() for p in procs]
        bad = [c for c in codes if c not in (None, 0)]
        if bad and not first_bad:
            first_bad = bad[0]
            deadline = min(deadline, time.monotonic() + 10.0)  # let the others report, then stop
        if all(c is not None for c in codes):
            return first_bad
        if time.monotonic() > deadline:
            return first_bad or 124
        time.sleep(0.05)


def stop(p) -> None:
    """Kill a process started with ``start_new_session=True``, with its whole group and
    every process below it in other sessions (a launcher's workers: :func:`.stopping.kill_tree`)."""
    if not isinstance(p.pid, int) or p.pid <= 1:  # (not a process of ours: nothing to stop)
        return
    if p.poll() is None:
        kill_tree([p.pid])
    if p.pid != os.getpgrp():  # its group's members left by a launcher that ended first
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    p.wait()
