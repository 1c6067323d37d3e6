"""Simulated nodes on one machine: ``python -m hvd_compress.tools.nodesrun --nodes N -np P CMD``.

Runs ``CMD`` as a ``P``-worker Horovod Gloo job whose workers Horovod sees in ``N``
nodes of ``P/N`` (host names ``node0``, ``node1``, ...): ``hvd.local_rank()``,
``hvd.cross_rank()`` and the sizes are those of a real cluster of that shape, so the
hierarchical exchange (:mod:`hvd_compress.core.hierarchy`) and its process sets
(:mod:`hvd_compress.nodes`) run as they would on one.  Every worker talks over this
machine's loopback: the links between the simulated nodes are not slower than those
inside them (``hvd-compress-compare``'s capped links are the tool for that).  Output
lines are prefixed with the rank as ``horovodrun`` prefixes them; a failing worker
stops the others; ``--timeout`` stops them all (status 124), and so do Ctrl-C and SIGTERM
(status 130, 143).
"""

from __future__ import annotations

import argparse
import sys

from .netcap import gloo_env
from .stopping import Stopped, stop_signals
from .workers import run_workers, usable_cores

__all__ = ["run", "main"]


def run(command: list[str], nodes: int, np_: int, timeout: float | None = None,
        env: dict | None = None, out=None) -> int:
    """Run ``command`` as ``np_`` workers in ``nodes`` simulated nodes; the first non-zero
    exit status, 124 on a time-out, else 0."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer
    if nodes < 1 or np_ % nodes:
        raise ValueError(f"-np {np_} does not fill {nodes} nodes of equal size")
    per = np_ // nodes
    plan = get_host_assignments(parse_hosts(",".join(f"node{i}:{per}" for i in range(nodes))), np_)
    server = RendezvousServer(verbose=0)
    port = server.start()
    try:
        server.init(plan)
        threads = max(1, usable_cores() // np_)
        envs = [{**(env or {}), **gloo_env(slot, "127.0.0.1", port, "lo", threads)} for slot in plan]
        return run_workers(command, envs, "nodesrun", timeout, out=out)
    finally:
        server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hvd_compress.tools.nodesrun",
        description="Run COMMAND as an NP-worker Horovod (Gloo) job that Horovod sees as NODES "
                    "nodes of NP/NODES workers, all on this machine.")
    ap.add_argument("--nodes", type=int, required=True, help="number of simulated nodes")
    ap.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                    help="number of workers (a multiple of --nodes)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="stop every worker after this many seconds (exit status 124)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the worker's command line")
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.np < 1 or args.np % args.nodes:
        ap.error("-np must be a positive multiple of --nodes")
    if not args.command:
        ap.error("a command to run is required")
    with stop_signals():  # SIGTERM too stops the workers, which run in sessions of their own
        try:
            return run(args.command, args.nodes, args.np, args.timeout)
        except Stopped as stop:
            print(f"nodesrun: {stop}; every worker stopped", file=sys.stderr, flush=True)
            return stop.exit_status


if __name__ == "__main__":
    sys.exit(main())
