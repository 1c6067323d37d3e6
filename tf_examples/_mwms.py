"""The examples' baseline without Horovod: TensorFlow's MultiWorkerMirroredStrategy.

The same Keras model, data shards, optimizer (SGD with momentum), batch size and
epochs as the Horovod run, trained with TensorFlow's own collective all-reduce
(launched by ``python -m hvd_compress.tools.mwms``, which sets ``TF_CONFIG``).  The
loop is written by hand (``strategy.run`` in a ``tf.function``): Keras 3's ``fit``
fails under this strategy (keras-team/keras#20585).  Each worker's loss is the mean
over its batch, which a Keras 3 loss divides by the number of workers under a
strategy by itself, and the optimizer sums the workers' gradients: their average, as
Horovod's.  The summary has the examples' keys, with
``"strategy": "mwms"``, the bytes of a dense float32 exchange and no time split
(encode / comm / decode null: not measured).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from hvd_compress.tools import runtools


def strategy_and_world(device: str = "cpu"):
    """The strategy (made first: TensorFlow must not have run anything before it), this
    worker's index and the number of workers, from ``TF_CONFIG``, and the summary's device
    (the worker placed as the Horovod examples place theirs: ``_common.place``, its index
    the local rank, the workers all on this machine); one share of the cores per worker,
    as the Horovod examples take."""
    check_launched()
    import tensorflow as tf
    from _common import place
    cfg = json.loads(os.environ["TF_CONFIG"])
    size = len(cfg["cluster"]["worker"])
    index = int(cfg["task"]["index"])
    label = place(tf, device, index)
    tf.config.threading.set_intra_op_parallelism_threads(runtools.worker_threads(size))
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return strategy, index, size, label


def check_launched() -> None:
    """Exit with how to launch where ``TF_CONFIG`` is not set (before TensorFlow loads)."""
    if "TF_CONFIG" not in os.environ:
        raise SystemExit("--strategy mwms needs TF_CONFIG: launch with "
                         "python -m hvd_compress.tools.mwms -np N python ...")


def check_args(ap, args) -> None:
    """What MWMS cannot do here: compression and the Horovod-side modes."""
    if str(args.compression) != "none":
        ap.error("--strategy mwms exchanges dense float32 (TensorFlow's all-reduce): "
                 "use --compression none")
    if args.local_sgd or args.delay or args.backward_passes_per_step != 1 or args.start_step:
        ap.error("--strategy mwms has no --local-sgd, --delay, --backward-passes-per-step "
                 "or --start-step")


def fit_and_report(args, example, strategy, rank, size, make_model, xtr, ytr, xte, yte,
                   steps_per_epoch, t_start, device="cpu") -> None:
    """Train ``make_model(keras)`` for ``args.epochs`` of ``steps_per_epoch`` steps on this
    worker's shard (every worker the same count: the collectives pair them up),
    evaluating after every epoch (the summary's curve); rank 0 writes the summary
    (``device``: where it ran, as :func:`strategy_and_world` returns it)."""
    import keras
    import tensorflow as tf
    keras.utils.set_random_seed(args.seed)  # the same initial weights on every worker
    with strategy.scope():
        model = make_model(keras)
        opt = keras.optimizers.SGD(args.lr, momentum=args.momentum)
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))  # (already / the workers)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica, args=(x, y))

    def accuracy():
        logits = model(xte, training=False)
        return float(np.mean(np.argmax(np.asarray(logits), axis=1) == yte))

    def from_rank0(answer: bool) -> bool:
        """Rank 0's answer on every worker: the strategy sums a vote only rank 0 casts."""
        votes = strategy.run(lambda: tf.constant(float(rank == 0 and answer)))
        return float(strategy.reduce(tf.distribute.ReduceOp.SUM, votes, axis=None)) > 0

    rng = np.random.default_rng(args.seed + rank)
    points, eval_s, steps, stopped = [], 0.0, 0, False
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(xtr))
        for b in range(steps_per_epoch):
            at = order[b * args.batch_size:(b + 1) * args.batch_size]
            train_step(tf.constant(xtr[at]), tf.constant(ytr[at]))
            steps += 1
        if epoch + 1 < args.epochs:
            now = time.perf_counter()
            points.append(runtools.curve_point(epoch + 1, now - t0 - eval_s, accuracy()))
            eval_s += time.perf_counter() - now
            if rank == 0 and not args.quiet:
                print(f"epoch {epoch + 1}: test accuracy {points[-1]['test_accuracy']:.4f}",
                      flush=True)
            if runtools.stop_agreed(args, points[-1]["test_accuracy"], from_rank0):
                stopped = True
                break
    if stopped:  # the target was met: that epoch is the last point
        train_s, acc = points[-1]["seconds"], points[-1]["test_accuracy"]
    else:
        train_s = time.perf_counter() - t0 - eval_s
        acc = accuracy()
        points.append(runtools.curve_point(args.epochs, train_s, acc))
    if rank == 0:
        if not args.quiet:
            print(f"test accuracy {acc:.4f} after {len(points)} epochs", flush=True)
        dense = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        doc = runtools.summary("tensorflow", example, "none", size, steps,
                               steps * args.batch_size * size, train_s,
                               {"bytes_sent": dense * steps}, acc, time.perf_counter() - t_start,
                               strategy="mwms", **runtools.local_fields(args), hierarchical=False,
                               exchange="", exchange_why={},
                               split_measured="not measured: TensorFlow's all-reduce runs inside "
                                              "its own step",
                               epochs=len(points), curve=points, device=device)
        runtools.write_summary(args.json, doc)
