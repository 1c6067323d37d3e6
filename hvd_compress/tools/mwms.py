"""Launch TensorFlow's MultiWorkerMirroredStrategy workers on this machine: the baseline
with TensorFlow's own collective all-reduce, no Horovod.

    python -m hvd_compress.tools.mwms -np 2 python tf_examples/train_digits.py --strategy mwms

Each worker gets ``TF_CONFIG`` (the cluster of every worker's ``host:port``, and its
own index), one share of this machine's cores (``HVD_COMPRESS_THREADS``, as
``horovodrun -np N`` gives its workers here), and its output lines prefixed with its
index as ``horovodrun`` prefixes them.  When a worker fails the others are stopped
and its exit status is the launcher's (TensorFlow's collectives would otherwise wait
for it); ``--timeout`` stops them all with status 124.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys

from .workers import run_workers, usable_cores


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` ports the system calls free now (a worker binds its own moments later)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(workers: list[str], index: int) -> str:
    """``TF_CONFIG`` for worker ``index`` of ``workers`` (``host:port`` each)."""
    return json.dumps({"cluster": {"worker": list(workers)},
                       "task": {"type": "worker", "index": int(index)}})


def run(command: list[str], np_: int, host: str = "127.0.0.1", timeout: float | None = None,
        env: dict | None = None, workers: list[str] | None = None, prefix=None,
        out=None) -> int:
    """Run ``command`` as ``np_`` workers; the first non-zero exit status (the others are
    stopped), 124 on a time-out, else 0.  ``workers``: their ``host:port`` (default:
    free ports on ``host``); ``env``: added to each worker's environment; ``prefix(i)``:
    what worker ``i``'s command line starts with (the capped links' namespaces); ``out``:
    where their output goes (stdout)."""
    workers = workers or [f"{host}:{port}" for port in free_ports(np_, host)]
    threads = max(1, usable_cores() // np_)
    envs = [{**(env or {}), "TF_CONFIG": tf_config(workers, i), "PYTHONUNBUFFERED": "1",
             "HVD_COMPRESS_THREADS": str(threads)} for i in range(np_)]
    return run_workers(command, envs, "mwms", timeout, prefix, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hvd_compress.tools.mwms",
        description="Run COMMAND as NP MultiWorkerMirroredStrategy workers on this machine "
                    "(TF_CONFIG set for each).")
    ap.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                    help="number of workers")
    ap.add_argument("--host", default="127.0.0.1", help="address the workers listen on "
                    "(default 127.0.0.1)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="stop every worker after this many seconds (exit status 124)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the worker's command line")
    args = ap.parse_args(argv)
    if args.np < 1:
        ap.error("-np must be at least 1")
    if not args.command:
        ap.error("a command to run is required")
    return run(args.command, args.np, args.host, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
