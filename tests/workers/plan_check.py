"""Bodies for tests/test_plan_agreement.py, run under horovodrun -np 2 --gloo.

Each case sets the ranks up differently -- as a configuration slip across hosts
does -- and runs a step; every rank must raise ``PlanMismatchError`` naming the
fields that differ (recorded per case), never hang.  Matching ranks train a few
steps with no error and exactly one agreement collective.  A missing check
shows as a case with no error or as a hang (the harness's time-out).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from hvd_compress import PlanMismatchError
from hvd_compress.core import agreement


@contextmanager
def counting():
    """Count the agreement collectives (``gather_bytes`` calls) made inside the block."""
    seen = {"gathers": 0}
    original = agreement.gather_bytes

    def counted(*args, **kwargs):
        seen["gathers"] += 1
        return original(*args, **kwargs)

    agreement.gather_bytes = counted
    try:
        yield seen
    finally:
        agreement.gather_bytes = original


def _outcome(fn) -> dict:
    """Run ``fn``; what it raised (type, fields, message) and the collectives it used."""
    with counting() as seen:
        try:
            fn()
        except PlanMismatchError as exc:
            return {"error": type(exc).__name__, "fields": list(exc.fields),
                    "message": str(exc), "gathers": seen["gathers"]}
        except Exception as exc:  # noqa: BLE001 - recorded: the test says what was expected
            return {"error": type(exc).__name__, "fields": [], "message": str(exc)[:2000],
                    "gathers": seen["gathers"]}
    return {"error": None, "fields": [], "message": "", "gathers": seen["gathers"]}


# -- PyTorch -------------------------------------------------------------------------------
def torch_cases() -> dict:
    import horovod.torch as hvd
    import torch

    import hvd_compress.torch as hc
    hvd.init()
    rank = hvd.rank()

    def model(extra=False):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)]
        return torch.nn.Sequential(*(layers + [torch.nn.Linear(2, 2)] if extra else layers))

    def train(spec="topk:ratio=0.25", steps=1, extra=False, bpps=1, **kwargs):
        net = model(extra)
        opt = hc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                      named_parameters=net.named_parameters(), compression=spec,
                                      backward_passes_per_step=bpps, **kwargs, min_numel=0)
        for step in range(steps):
            for micro in range(bpps):
                g = torch.Generator().manual_seed(100 * rank + 10 * step + micro)
                x = torch.randn(5, 6, generator=g)
                torch.nn.functional.cross_entropy(net(x), torch.arange(5) % 2).backward()
            opt.step()
            opt.zero_grad()
        opt.drain()
        return net

    def differ(**by_rank):
        """``train`` with each keyword's value taken from its (rank 0, rank 1) pair."""
        return lambda: train(**{k: v[rank] for k, v in by_rank.items()})

    horovods = lambda spec: lambda: _horovod_torch(hvd, torch, model, spec, rank)  # noqa: E731
    cases = {
        "ratio": differ(spec=("topk:ratio=0.01", "topk:ratio=0.1")),
        "algorithm": differ(spec=("topk:ratio=0.1", "qsgd:levels=7")),
        "op": differ(op=(hvd.Average, hvd.Sum)),
        "tensors": differ(extra=(False, True)),
        "bpps": differ(bpps=(1, 2)),
        "predivide": differ(gradient_predivide_factor=(1.0, 2.0)),
        "local_sgd": differ(local_sgd=(True, False)),
        "delay": differ(delay=(1, 0)),
        "contract": horovods(("fp16", "bf16")[rank]),
        # matching ranks: no error, one agreement collective over several steps
        "same": lambda: train(steps=3),
        "same_none": lambda: train("none", steps=3),
        "same_local_sgd": lambda: train(steps=4, local_sgd=True),
        "same_delay": lambda: train(steps=3, delay=1),
        "same_bpps": lambda: train(steps=2, bpps=2),
        "same_contract": horovods("fp16"),
    }
    out = {name: _outcome(fn) for name, fn in cases.items()}
    # after all that, training still works (nothing was left in flight)
    out["after"] = _outcome(lambda: train(steps=2))
    return out


def _horovod_torch(hvd, torch, model, spec, rank, steps=3):
    """Our compressor inside Horovod's own optimizer (its compress()/decompress())."""
    import hvd_compress.torch as hc
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(),
                                   compression=hc.compressor(spec))
    for step in range(steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * rank + step))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), torch.arange(5) % 2).backward()
        opt.step()


# -- TensorFlow ----------------------------------------------------------------------------
def tf_cases() -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank = hvd.rank()

    def variables(extra=False):
        w = tf.Variable(tf.ones([6, 2]), name="w")
        b = tf.Variable(tf.zeros([2]), name="b")
        return [w, b] + ([tf.Variable(tf.ones([3]), name="extra")] if extra else [])

    def tape_run(spec="topk:ratio=0.25", steps=1, extra=False, traced=False, **kwargs):
        vs = variables(extra)

        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((tf.matmul(x, vs[0]) + vs[1]) ** 2)
                loss += sum(tf.reduce_sum(v) for v in vs[2:])
            tape = hct.DistributedGradientTape(tape, compression=spec, **kwargs, min_numel=0)
            grads = tape.gradient(loss, vs)
            for v, g in zip(vs, grads):
                v.assign_sub(0.01 * g)
            return loss

        fn = tf.function(step) if traced else step
        for i in range(steps):
            fn(tf.random.stateless_normal([4, 6], seed=[rank, i]))

    def keras_fit(spec="topk:ratio=0.25", steps=3, **kwargs):
        import keras
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=spec,
                                             **kwargs, min_numel=0)
        model.compile(optimizer=opt, loss="mse")
        x = np.random.default_rng(rank).normal(size=(4 * steps, 6)).astype("float32")
        model.fit(x, x[:, :2], batch_size=4, epochs=1, verbose=0, shuffle=False)

    def horovods(spec, steps=3):
        vs, comp = variables(), hct.compressor(spec)  # one compressor: its state, its check
        for i in range(steps):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.matmul(tf.ones([2, 6]) * (rank + i), vs[0]) + vs[1])
            tape = hvd.DistributedGradientTape(tape, compression=comp)
            tape.gradient(loss, vs)

    cases = {}
    for mode in ("eager", "traced"):
        def differ(traced=mode == "traced", **by_rank):
            return lambda: tape_run(traced=traced, **{k: v[rank] for k, v in by_rank.items()})
        cases.update({
            f"{mode}_ratio": differ(spec=("topk:ratio=0.01", "topk:ratio=0.1")),
            f"{mode}_algorithm": differ(spec=("topk:ratio=0.1", "qsgd:levels=7")),
            f"{mode}_op": differ(op=(hvd.Average, hvd.Sum)),
            f"{mode}_tensors": differ(extra=(False, True)),
            f"{mode}_delay": differ(delay=(1, 0)),
            f"{mode}_same": lambda traced=mode == "traced": tape_run(steps=3, traced=traced),
            f"{mode}_same_local_sgd": lambda traced=mode == "traced": tape_run(
                steps=3, traced=traced, local_sgd=True, backward_passes_per_step=2),
        })
    cases.update({
        "keras_ratio": lambda: keras_fit(("topk:ratio=0.01", "topk:ratio=0.1")[rank]),
        "keras_op": lambda: keras_fit(op=(hvd.Average, hvd.Sum)[rank]),
        "keras_same": lambda: keras_fit(),
        "contract": lambda: horovods(("fp16", "bf16")[rank]),
        "same_contract": lambda: horovods("fp16"),
    })
    out = {name: _outcome(fn) for name, fn in cases.items()}
    out["after"] = _outcome(lambda: tape_run(steps=2, traced=True))
    return out
