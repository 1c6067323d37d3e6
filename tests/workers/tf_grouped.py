"""Bodies for tests/test_tensorflow_grouped.py: the allreduces HorovodTF holds and
runs as one grouped allreduce, against each run alone."""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# (shape, dtype, op, prescale, postscale): the digits CNN's gradients (a float sum and
# Horovod's native Average with gradient_predivide_factor 4, as `none` sends them), an
# integer sum (the integer-summed quantizers' codes), a maximum (their scales), float16
CASES = [((3, 3, 1, 16), "float32", "sum", 1.0, 1.0), ((16,), "float32", "sum", 1.0, 1.0),
         ((3, 3, 16, 32), "float32", "sum", 1.0, 1.0), ((100003,), "float32", "sum", 1.0, 1.0),
         ((800, 64), "float32", "average", 0.25, 4.0), ((64,), "float32", "average", 0.25, 4.0),
         ((5000,), "int32", "sum", 1.0, 1.0), ((77,), "int32", "sum", 1.0, 1.0),
         ((40,), "float32", "max", 1.0, 1.0), ((9,), "float32", "max", 1.0, 1.0),
         ((300,), "float16", "sum", 1.0, 1.0), ((31,), "float16", "sum", 1.0, 1.0)]


def grouped_matches_one_by_one(traced=False):
    """Start every case's allreduce through HorovodTF, eagerly or inside a
    ``tf.function`` (``traced``), wait on the last one first (the first wait runs
    everything held), and compare each result with the same allreduce run alone,
    eagerly.  Returns per case whether the bits are equal, the sizes of the groups
    ``hvd.grouped_allreduce`` was called with and how many allreduces are still held."""
    import tensorflow as tf

    from hvd_compress.core.exchange import MAX
    from hvd_compress.tensorflow.exchange import HorovodTF

    from .tf_patterns import init_with_pair
    hvd, _ = init_with_pair()  # (at np 3 in the launch tests.launches.TF_GLOO3)
    ops = {"sum": None, "max": MAX, "average": hvd.Average}
    hvd_ops = {"sum": hvd.Sum, "max": hvd.Max, "average": hvd.Average}
    rng = np.random.default_rng(hvd.rank())
    xs = []
    for shape, dtype, _, _, _ in CASES:
        if dtype == "int32":
            xs.append(tf.constant(rng.integers(-1000, 1000, shape).astype(np.int32)))
        else:  # magnitudes over six decades: a different order of the sum shows in the bits
            x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)
            xs.append(tf.constant(x.astype(dtype if dtype != "float16" else np.float32)
                                  .astype(dtype)))
    groups, real = [], hvd.grouped_allreduce

    def counted(tensors, *args, **kwargs):
        groups.append(len(tensors))
        return real(tensors, *args, **kwargs)

    coll = HorovodTF(hvd.global_process_set)

    def exchange(*xs):
        handles = [coll.allreduce(x, f"t{i}", op=ops[op], prescale=pre, postscale=post)
                   for i, (x, (_, _, op, pre, post)) in enumerate(zip(xs, CASES))]
        got = [None] * len(handles)
        for i in reversed(range(len(handles))):
            got[i] = coll.wait(handles[i])
        return got

    hvd.grouped_allreduce = counted
    try:
        got = [g.numpy() for g in (tf.function(exchange) if traced else exchange)(*xs)]
    finally:
        hvd.grouped_allreduce = real
    alone = [hvd.allreduce(x, op=hvd_ops[op], name=f"alone{i}", prescale_factor=pre,
                           postscale_factor=post).numpy()
             for i, (x, (_, _, op, pre, post)) in enumerate(zip(xs, CASES))]
    return {"equal": [bool(np.array_equal(a, b)) for a, b in zip(got, alone)],
            "groups": sorted(groups), "held": sum(map(len, coll._deferred.values()))}
