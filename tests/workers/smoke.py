"""Smoke-test bodies run by tests/test_smoke_multiprocess.py under real launches.

Each checks its collectives itself (so a wrong answer fails inside the worker,
with its traceback shown) and returns what it saw for the test to check again.
"""

import numpy as np


def torch_collectives():
    import horovod.torch as hvd
    import torch

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = torch.arange(6, dtype=torch.float32) + 10.0 * rank
    summed = hvd.allreduce(x, op=hvd.Sum, name="smoke.sum")
    expect = sum(torch.arange(6, dtype=torch.float32) + 10.0 * r for r in range(size))
    assert torch.equal(summed, expect), (summed, expect)
    avg = hvd.allreduce(x, name="smoke.avg")
    assert torch.allclose(avg, expect / size)
    # Different first-dimension sizes per rank: rank r contributes r+1 rows.
    rows = torch.full((rank + 1, 3), float(rank))
    gathered = hvd.allgather(rows, name="smoke.gather")
    want = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
    assert torch.equal(gathered, want), gathered
    return {"rank": rank, "size": size, "sum": summed.tolist(),
            "gather_rows": gathered.shape[0], "gather_first_col": gathered[:, 0].tolist()}


def tensorflow_collectives():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = tf.range(6, dtype=tf.float32) + 10.0 * rank
    summed = hvd.allreduce(x, op=hvd.Sum, name="smoke.sum")
    expect = sum(np.arange(6, dtype=np.float32) + 10.0 * r for r in range(size))
    np.testing.assert_array_equal(summed.numpy(), expect)
    rows = tf.fill((rank + 1, 3), float(rank))
    gathered = hvd.allgather(rows, name="smoke.gather")
    want = np.concatenate([np.full((r + 1, 3), float(r), np.float32) for r in range(size)])
    np.testing.assert_array_equal(gathered.numpy(), want)

    @tf.function
    def traced(t):
        return hvd.allreduce(t, op=hvd.Sum, name="smoke.traced")

    np.testing.assert_array_equal(traced(x).numpy(), expect)
    return {"rank": rank, "size": size, "sum": summed.numpy().tolist(),
            "gather_rows": int(gathered.shape[0]),
            "gather_first_col": gathered.numpy()[:, 0].tolist()}


def mpi4py_allgather():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = np.full(rank + 1, rank, dtype=np.int64)
    counts = comm.allgather(mine.size)
    out = np.empty(sum(counts), dtype=np.int64)
    comm.Allgatherv(mine, (out, counts))
    want = np.concatenate([np.full(r + 1, r, dtype=np.int64) for r in range(size)])
    np.testing.assert_array_equal(out, want)
    return {"rank": rank, "size": size, "gathered": out.tolist()}


def fail_on_rank_one():
    """Used to check that the harness reports a failing worker's traceback."""
    import os

    if os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK")) == "1":
        raise RuntimeError("deliberate failure on rank 1")
    return {"ok": True}


def sleep(seconds):
    """Used to check that the harness kills a launch that runs past its time-out."""
    import time

    time.sleep(seconds)
    return {"slept": seconds}
