"""A new algorithm needs no framework code: one core class and one registry entry.

This file defines a toy compressor (scaled sign with error feedback: the mean
magnitude and one sign per element, a float32 payload gathered from every
rank), registers it, and trains with it through the PyTorch optimizer and the
TensorFlow tape under ``horovodrun -np 2``.  Each worker checks its first
step against the numpy reference: the average of every rank's payload decoded
by the numpy core.
"""

import numpy as np
import pytest

from hvd_compress import spec as specmod
from hvd_compress.core import Encoded, build
from hvd_compress.core.base import Compressor
from hvd_compress.core.registry import Algorithm, Param, register, unregister
from tests.launches import TF_GLOO, TORCH_GLOO

LR = 0.1


class ScaledSign(Compressor):
    """mean|v| * sign(v): one float32 scale and one float32 sign per element."""

    name = "toysign"

    def payload_nbytes(self, meta):
        return 4 * (meta.numel + 1)

    def _encode(self, v, meta, st, noise, flag):
        B = self.B
        scale = B.cast(B.div(B.sum64(B.abs(v)), float(meta.numel)), "float32")
        scale = B.reshape(scale if flag is None else scale * flag, (1,))
        return Encoded(B.concat([scale, B.sign(v)]), meta, self.payload_nbytes(meta))

    def _decode(self, payload, meta, ctx):
        return payload[1:] * payload[0]


def _register():
    """Register the toy (in the test process for its tests only; in each worker)."""
    register(Algorithm("toysign", "ToySign", ScaledSign,
                       params={"ef": Param(bool, True, None, "error feedback")},
                       doc="Toy: scaled sign with error feedback (tests only)."), replace=True)


@pytest.fixture
def toy():
    _register()
    yield
    unregister("toysign")  # the rest of the suite sees the built-in catalogue only


def _data(rank, step):
    """Each rank's own fixed batch (the same every step, so the loss can only fall)."""
    rng = np.random.default_rng([rank, 7])
    return rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal(8).astype(np.float32)


def _reference_first_step(w0, grads):
    """w0 - LR * mean over ranks of the numpy core's decoded payloads (first step)."""
    total = 0
    for rank, g in enumerate(grads):
        comp = build("toysign", rank=rank, world_size=len(grads))
        enc = comp.encode(np.asarray(g, np.float32), "w")
        total = total + comp.decode(enc.payload, enc.meta, enc.ctx)
    return w0 - LR * total / len(grads)


def _registered_while(worker):
    """``worker`` with the toy registered while it runs (the workers run in launches that
    other modules share: the bodies after them see the built-in catalogue only)."""
    def run(**kwargs):
        _register()
        try:
            return worker(**kwargs)
        finally:
            unregister("toysign")
    run.__name__ = worker.__name__
    return run


@_registered_while
def torch_worker(steps=6):
    import horovod.torch as hvd
    import torch

    import hvd_compress.torch as hc
    hvd.init()
    rank = hvd.rank()
    w = torch.nn.Parameter(torch.full((5,), 0.5))
    opt = hc.DistributedOptimizer(torch.optim.SGD([w], lr=LR), named_parameters=[("w", w)],
                                  compression=hc.ToySign(), min_numel=0)
    losses, first = [], None
    for step in range(steps):
        x, y = (torch.from_numpy(a) for a in _data(rank, step))
        w0 = w.detach().numpy().copy()
        opt.zero_grad()
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        grads = hvd.allgather_object(w.grad.numpy().tolist())
        opt.step()
        if step == 0:
            first = float(np.max(np.abs(w.detach().numpy() - _reference_first_step(w0, grads))))
        losses.append(float(loss))
    return {"first_step_err": first, "losses": losses, "w": w.detach().numpy().tolist(),
            "class": type(opt.compression).__name__, "bytes": opt.last_stats["bytes_sent"]}


@_registered_while
def tf_worker(steps=6):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank = hvd.rank()
    w = tf.Variable(tf.fill([5], 0.5), name="w")
    losses, first = [], None
    for step in range(steps):
        x, y = _data(rank, step)
        w0 = w.numpy().copy()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.linalg.matvec(x, w) - y) ** 2)
        local = tape.gradient(loss, [w])[0]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.linalg.matvec(x, w) - y) ** 2)
        tape = hct.DistributedGradientTape(tape, compression="toysign", min_numel=0)
        (g,) = tape.gradient(loss, [w])
        w.assign_sub(LR * g)
        if step == 0:
            grads = hvd.allgather_object(local.numpy().tolist())
            first = float(np.max(np.abs(w.numpy() - _reference_first_step(w0, grads))))
        losses.append(float(loss))
    return {"first_step_err": first, "losses": losses, "w": w.numpy().tolist(),
            "class": type(hct.ToySign()).__name__, "bytes": tape.last_stats["bytes_sent"]}


def test_the_toy_is_a_known_spec_with_named_classes(toy):
    assert "toysign" in specmod.NAMES
    assert str(specmod.parse("toysign:ef=false")) == "toysign:ef=false"
    with pytest.raises(ValueError, match="unknown parameter"):
        specmod.parse("toysign:ratio=0.1")
    assert "toysign:ef=true" in specmod.describe()


# the workers run in the np 2 Gloo launches other modules share (tests.launches)
WORKERS = {"torch_worker": TORCH_GLOO, "tf_worker": TF_GLOO}
for _worker, _launch in WORKERS.items():
    _launch.add(__name__, _worker, f"tests.test_toy_compressor:{_worker}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("worker", list(WORKERS))
def test_a_registered_toy_trains_through_each_framework(worker, toy, request):
    results = WORKERS[worker].results(request, worker)
    for res in results:
        assert res["first_step_err"] < 1e-6
        assert res["class"] == "ToySign"
        assert res["bytes"] == 4 * (5 + 1)  # exactly the toy's payload, once per step
    assert sum(r["losses"][-1] for r in results) < sum(r["losses"][0] for r in results)
    assert results[0]["w"] == results[1]["w"]  # ranks agree


class Verbatim(Compressor):
    """The values themselves, decoded as a view of the payload (what a new compressor may
    well write): the base ``aggregate`` must not add into a received payload."""

    name = "toyverbatim"

    def payload_nbytes(self, meta):
        return 4 * meta.numel

    def _encode(self, v, meta, st, noise, flag):
        return Encoded(self.B.copy(v), meta, self.payload_nbytes(meta))

    def _decode(self, payload, meta, ctx):
        return payload


def test_aggregate_leaves_a_payload_its_decode_returns_as_is():
    comp = Verbatim({"ef": False})
    encs = [comp.encode(np.full(4, float(r + 1), np.float32), "w") for r in range(3)]
    received = [e.payload for e in encs]
    total = comp.aggregate(received, encs[0])
    np.testing.assert_array_equal(total, np.full(4, 6.0, np.float32))
    for r, p in enumerate(received):
        np.testing.assert_array_equal(p, np.full(4, float(r + 1), np.float32))
