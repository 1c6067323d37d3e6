"""Bodies for tests/test_tensorflow_local_steps.py, run under horovodrun -np 2.

The tiny model of tests/workers/local_hand.py in TensorFlow: BatchNorm by hand
(batch statistics; running mean and unbiased running variance kept in
variables, the "buffers"), then ``x @ w + b``, squared loss, plain SGD.  Both
our tape (with ``finish_step()``) and our Keras optimizer (``apply``) run it,
eagerly or inside ``tf.function``.
"""

from __future__ import annotations

import os

import numpy as np

from tests.workers.local_hand import BN_MOMENTUM, EPS, LR, HandDGA, HandLocalSGD, data

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

W0, B0 = np.array([0.3, -0.1, 0.2, 0.05], np.float32), 0.1


class TinyTF:
    def __init__(self, bn=True):
        import keras
        import tensorflow as tf
        self.tf = tf
        self.bn = bn
        self.w = keras.Variable(W0[:, None], name="w")
        self.b = keras.Variable(np.array([B0], np.float32), name="b")
        self.rm = keras.Variable(np.zeros(4, np.float32), name="rm", trainable=False)
        self.rv = keras.Variable(np.ones(4, np.float32), name="rv", trainable=False)
        self.trainable_variables = [self.w, self.b]
        self.buffers = [self.rm, self.rv]

    def loss(self, x, y):
        tf = self.tf
        if self.bn:
            mean, var = tf.nn.moments(x, [0])
            n = float(x.shape[0])
            self.rm.assign((1 - BN_MOMENTUM) * self.rm + BN_MOMENTUM * mean)
            self.rv.assign((1 - BN_MOMENTUM) * self.rv + BN_MOMENTUM * var * n / (n - 1))
            x = (x - mean) / tf.sqrt(var + EPS)
        pred = tf.squeeze(tf.matmul(x, self.w), 1) + self.b
        return tf.reduce_mean((pred - y) ** 2)

    def flat(self):
        return np.concatenate([np.asarray(self.w).reshape(-1), np.asarray(self.b)]).astype(float)


def _runner(api, model, spec, traced, **local):
    """A step function ``step(x, y)`` through our tape or our Keras optimizer."""
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    comp = hct.TFCompressor(spec)  # its own state (counter, anchors, rings)
    if api == "keras":
        opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(LR), compression=comp,
                                             buffers=model.buffers, **local, min_numel=0)
        opt.build(model.trainable_variables)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = model.loss(x, y)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return opt.last_stats["collectives"]

        drain = opt.drain
    else:
        opt = keras.optimizers.SGD(LR)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = model.loss(x, y)
            tape = hct.DistributedGradientTape(tape, compression=comp, buffers=model.buffers,
                                               **local, min_numel=0)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            tape.finish_step()
            last["tape"] = tape
            return tape.last_stats["collectives"]

        last = {}

        def drain():
            last["tape"].drain()
    return (tf.function(step) if traced else step), drain


def local_sgd(api="tape", spec="none", period=4, steps=10, warmup=0, traced=False):
    import horovod.tensorflow as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = TinyTF()
    step_fn, _ = _runner(api, model, spec, traced, local_sgd=True, backward_passes_per_step=period,
                      local_sgd_warmup_steps=warmup)
    hand = HandLocalSGD(W0, B0, size, period, warmup)
    mine = hand.hands[rank]
    log = []
    for step in range(steps):
        collectives = step_fn(*data(rank, step))
        hand.step(step)
        log.append({"params": hvd.allgather_object(model.flat().tolist()),
                    "buffers": hvd.allgather_object([np.asarray(model.rm).astype(float).tolist(),
                                                     np.asarray(model.rv).astype(float).tolist()]),
                    "hand": mine.flat.tolist(), "hand_buffers": [mine.rm.tolist(), mine.rv.tolist()],
                    "collectives": None if traced else int(collectives),
                    "bytes": None})
    return log


def dga(api="tape", spec="none", delay=2, steps=8, traced=False):
    import horovod.tensorflow as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = TinyTF(bn=False)
    step_fn, drain = _runner(api, model, spec, traced, delay=delay)
    sync_model = TinyTF(bn=False)
    sync_fn, _ = _runner(api, sync_model, spec, traced)
    hand = HandDGA(W0, B0, size, delay)
    # the same by hand with the compressor's exchange (numpy), named as the tape names
    exact = HandDGA(W0, B0, size, delay, spec=spec,
                    layout=[(getattr(v, "path", None) or v.name, tuple(v.shape))
                            for v in model.trainable_variables])
    log = []
    for step in range(steps):
        step_fn(*data(rank, step))
        sync_fn(*data(rank, step))
        hand.step(step)
        exact.step(step)
        log.append({"params": model.flat().tolist(), "hand": hand.hands[rank].flat.tolist(),
                    "hand_compressed": exact.hands[rank].flat.tolist(),
                    "sync": sync_model.flat().tolist()})
    drain()
    return log
