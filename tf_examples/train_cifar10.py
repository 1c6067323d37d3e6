#!/usr/bin/env python
"""Keras ``fit`` of a ResNet on CIFAR-10 from the standard python-pickle batches in --data-dir.

    horovodrun -np 2 python tf_examples/train_cifar10.py --data-dir ~/data/cifar-10-batches-py \\
        --compression dgc:ratio=0.001 --epochs 30

--data-dir holds ``data_batch_1`` ... ``data_batch_5`` and ``test_batch`` (the
"CIFAR-10 python version" archive, unpacked; nothing is downloaded).  Training
images are split across the workers, normalised per channel, randomly flipped
and shifted; the test accuracy is reported at the end.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import resnet  # noqa: E402

from hvd_compress import runtools  # noqa: E402
from hvd_compress.datasets import cifar10  # noqa: E402


def main(argv=None):
    ap = runtools.common_parser(__doc__.split("\n\n")[0], epochs=10, batch_size=64, lr=0.05)
    ap.add_argument("--data-dir", required=True, help="folder with the CIFAR-10 python batches")
    ap.add_argument("--width", type=runtools.positive_int, default=16)
    ap.add_argument("--blocks", type=runtools.positive_int, nargs="+", default=[1, 1, 1])
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--limit-train", type=int, default=0, help="use only the first N images (0: all)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    try:
        xtr, ytr = cifar10(args.data_dir, train=True)
        xte, yte = cifar10(args.data_dir, train=False)
    except FileNotFoundError as exc:
        raise SystemExit(f"train_cifar10: {exc}") from None
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // size))
    keras.utils.set_random_seed(args.seed)
    if args.limit_train > 0:
        xtr, ytr = xtr[:args.limit_train], ytr[:args.limit_train]
    xtr, ytr = xtr[rank::size].transpose(0, 2, 3, 1), ytr[rank::size]  # channels last
    xte = xte.transpose(0, 2, 3, 1)
    body = resnet(keras, args.width, args.blocks, 32, 10)
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.RandomFlip("horizontal"),
                              keras.layers.RandomTranslation(0.125, 0.125), body])
    comp = hct.compressor(args.compression)
    momentum = 0.0 if comp.spec.parts[0].name == "dgc" else args.momentum  # DGC has its own
    opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=momentum),
                                         compression=comp,
                                         backward_passes_per_step=args.backward_passes_per_step)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    for v in model.variables:  # the same initial weights everywhere
        v.assign(hvd.broadcast(v.value, root_rank=0, name=f"init.{v.path}"))

    class Epochs(keras.callbacks.Callback):
        steps = 0

        def on_epoch_begin(self, epoch, logs=None):
            comp.set_epoch(epoch)

        def on_train_batch_end(self, batch, logs=None):
            Epochs.steps += 1

    t0 = time.perf_counter()
    model.fit(xtr, ytr, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              verbose=2 if rank == 0 and not args.quiet else 0, callbacks=[Epochs()])
    train_s = time.perf_counter() - t0
    acc = float(model.evaluate(xte, yte, verbose=0)[1])
    if rank == 0:
        if not args.quiet:
            print(f"test accuracy {acc:.4f} after {args.epochs} epochs", flush=True)
        updates = max(1, Epochs.steps // args.backward_passes_per_step)
        core = comp.core
        nbytes = sum(core.payload_nbytes(core.meta_for(v.value, v.path))
                     for v in model.trainable_variables)
        doc = runtools.summary("tensorflow", "train_cifar10", args.compression, size, updates,
                               Epochs.steps * args.batch_size * size, train_s,
                               {"bytes_sent": nbytes * updates}, acc,
                               time.perf_counter() - t_start, epochs=args.epochs)
        runtools.write_summary(args.json, doc)


if __name__ == "__main__":
    main()
