#!/usr/bin/env python
"""Keras ``fit`` of a small CNN on scikit-learn's bundled 8x8 digits, sharded across ranks.

    horovodrun -np 2 python tf_examples/train_digits.py --compression topk:ratio=0.01

The same data and split as torch_examples/train_digits.py (1,437 training images
split across the workers, 360 held out); the model is compiled with
``hvd_compress.tensorflow.keras.DistributedOptimizer``.  With DGC the warm-up
epoch is set by a callback.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_compress import runtools  # noqa: E402
from hvd_compress.datasets import digits_split  # noqa: E402


def main(argv=None):
    ap = runtools.common_parser(__doc__.split("\n\n")[0], epochs=15, batch_size=16, lr=0.02)
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // size))
    keras.utils.set_random_seed(args.seed)
    xtr, ytr, xte, yte = (a[..., None] if a.ndim == 3 else a for a in digits_split())
    xtr, ytr = xtr[rank::size], ytr[rank::size]
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    comp = hct.compressor(args.compression)
    momentum = args.momentum
    if comp.spec.parts[0].name == "dgc":  # DGC applies momentum itself (momentum correction)
        momentum = 0.0
    opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=momentum),
                                         compression=comp,
                                         backward_passes_per_step=args.backward_passes_per_step)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    # the same initial weights everywhere
    for v in model.trainable_variables:
        v.assign(hvd.broadcast(v.value, root_rank=0, name=f"init.{v.path}"))

    class Epochs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.bytes, self.steps = 0, 0

        def on_epoch_begin(self, epoch, logs=None):
            comp.set_epoch(epoch)

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1

    epochs_cb = Epochs()
    t0 = time.perf_counter()
    model.fit(xtr, ytr, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              verbose=2 if rank == 0 and not args.quiet else 0, callbacks=[epochs_cb])
    train_s = time.perf_counter() - t0
    acc = float(model.evaluate(xte, yte, verbose=0)[1])
    if rank == 0:
        if not args.quiet:
            print(f"test accuracy {acc:.4f} after {args.epochs} epochs", flush=True)
        updates = max(1, epochs_cb.steps // args.backward_passes_per_step)
        nbytes = sum(comp.core.payload_nbytes(comp.core.meta_for(v.value, v.path))
                     for v in model.trainable_variables)
        stats = {"bytes_sent": nbytes * updates}
        doc = runtools.summary("tensorflow", "train_digits", args.compression, size, updates,
                               epochs_cb.steps * args.batch_size * size, train_s, stats, acc,
                               time.perf_counter() - t_start, epochs=args.epochs)
        runtools.write_summary(args.json, doc)


if __name__ == "__main__":
    main()
