"""Start a job's worker processes on this machine and wait for them: each with its own
environment (and command prefix), their output lines prefixed with their index as
``horovodrun`` prefixes them, the others stopped when one fails, all of them on a
time-out.  The launchers of TensorFlow's MultiWorkerMirroredStrategy (:mod:`.mwms`) and
of simulated nodes (:mod:`.nodesrun`) start their workers here."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading

__all__ = ["run_workers"]


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
    from .netcap import stop, wait_all
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
