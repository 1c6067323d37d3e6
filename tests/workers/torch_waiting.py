"""Bodies for tests/test_torch_waiting.py, run in the shared ``horovodrun -np 2 --gloo``
launch: the exchange's wait (hvd_compress.torch.waiting) gives Horovod's results in both
modes, and its napping wait leaves the CPU to others where Horovod's own spins."""

from __future__ import annotations

import os
import time

import torch


def results_and_cpu(late_s: float = 0.3):
    """Per mode (``nap``, ``spin``): an allreduce, an allgather of unequal rows and the kept
    part of a CPU reduce-scatter through :class:`HorovodTorch`, and rank 0's main-thread CPU
    seconds and wall seconds waiting for an allreduce that rank 1 joins ``late_s`` late."""
    import horovod.torch as hvd

    from hvd_compress.torch.collectives import HorovodTorch
    if not hvd.is_initialized():
        hvd.init()
    coll = HorovodTorch(hvd.global_process_set)
    r = hvd.rank()
    out, before = {}, os.environ.get("HVD_COMPRESS_WAIT")
    try:
        for mode in ("nap", "spin"):
            os.environ["HVD_COMPRESS_WAIT"] = mode
            x = torch.arange(6, dtype=torch.float32) * (r + 1)
            summed = coll.wait(coll.allreduce(x, f"waiting.sum.{mode}"))
            rows = coll.wait(coll.allgather(torch.full((r + 1, 2), float(r)), f"waiting.rows.{mode}"))
            part = coll.wait(coll.reducescatter(torch.arange(4, dtype=torch.float32),
                                                f"waiting.rs.{mode}"))
            coll.wait(coll.allreduce(torch.zeros(1), f"waiting.ready.{mode}"))  # start together
            if r == 1:
                time.sleep(late_s)
            handle = coll.allreduce(torch.ones(3), f"waiting.late.{mode}")
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            late = coll.wait(handle)
            cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
            out[mode] = {"sum": summed.tolist(), "rows": rows.tolist(), "part": part.tolist(),
                         "late": late.tolist(), "cpu_s": cpu, "wall_s": wall}
    finally:  # the launch's environment as it was, for the bodies after this one
        if before is None:
            os.environ.pop("HVD_COMPRESS_WAIT", None)
        else:
            os.environ["HVD_COMPRESS_WAIT"] = before
    return out


def examples_all_workers(late_s: float = 0.3):
    """The examples' barrier before and after an evaluation (torch_examples/_common.py
    ``all_workers``), rank 1 reaching it ``late_s`` late: rank 0's main-thread CPU seconds
    and wall seconds in it."""
    import sys
    from pathlib import Path

    import horovod.torch as hvd
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch_examples"))
    from _common import all_workers
    if not hvd.is_initialized():
        hvd.init()
    device = torch.device("cpu")
    all_workers(device)  # start together
    if hvd.rank() == 1:
        time.sleep(late_s)
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    all_workers(device)
    return {"cpu_s": time.thread_time() - cpu0, "wall_s": time.perf_counter() - wall0}
