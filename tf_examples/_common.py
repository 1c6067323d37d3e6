"""Helpers the TensorFlow examples share: Horovod set-up, Keras fit plumbing, the summary."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_compress import runtools  # noqa: E402


def init(seed: int):
    """hvd.init(), one thread pool share per worker, seeds; returns (hvd, keras, tf, hct)."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    threads = runtools.worker_threads(hvd.local_size())
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    runtools.limit_kernel_threads(threads)
    keras.utils.set_random_seed(seed)
    return hvd, keras, tf, hct


def broadcast_initial(hvd, model) -> None:
    """The same initial weights on every rank."""
    for v in model.variables:
        v.assign(hvd.broadcast(v.value, root_rank=0, name=f"init.{v.path}"))


def keras_optimizer(keras, hct, args, comp):
    """SGD wrapped in our Keras DistributedOptimizer; DGC keeps the momentum itself."""
    momentum = 0.0 if comp.spec.parts[0].name == "dgc" else args.momentum
    return hct.keras.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=momentum),
                                          compression=comp,
                                          backward_passes_per_step=args.backward_passes_per_step)


def epoch_callback(keras, comp):
    """A callback that sets DGC's warm-up epoch and counts batches (``.steps``)."""

    class Epochs(keras.callbacks.Callback):
        steps = 0

        def on_epoch_begin(self, epoch, logs=None):
            comp.set_epoch(epoch)

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1

    return Epochs()


def bytes_per_update(comp, variables) -> int:
    core = comp.core
    return sum(core.payload_nbytes(core.meta_for(v.value, v.path)) for v in variables)


def finish(args, example, comp, variables, batches, size, train_s, accuracy, wall_s,
           **extra) -> None:
    """Print and (with --json) write the summary; rank 0 only calls it."""
    updates = max(1, batches // args.backward_passes_per_step)
    doc = runtools.summary("tensorflow", example, args.compression, size, updates,
                           batches * args.batch_size * size, train_s,
                           {"bytes_sent": bytes_per_update(comp, variables) * updates},
                           accuracy, wall_s, **extra)
    runtools.write_summary(args.json, doc)


def fit_and_report(args, example, hvd, keras, model, comp, optimizer, xtr, ytr, xte, yte,
                   t_start):
    """Compile, broadcast the initial weights, fit, evaluate, and write the summary."""
    import time

    rank, size = hvd.rank(), hvd.size()
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    broadcast_initial(hvd, model)
    epochs = epoch_callback(keras, comp)
    t0 = time.perf_counter()
    model.fit(xtr, ytr, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              verbose=2 if rank == 0 and not args.quiet else 0, callbacks=[epochs])
    train_s = time.perf_counter() - t0
    acc = float(model.evaluate(xte, yte, verbose=0)[1])
    if rank == 0:
        if not args.quiet:
            print(f"test accuracy {acc:.4f} after {args.epochs} epochs", flush=True)
        finish(args, example, comp, model.trainable_variables, epochs.steps, size, train_s, acc,
               time.perf_counter() - t_start, epochs=args.epochs)
