#!/usr/bin/env python
"""Keras ``fit`` of a ResNet on CIFAR-10 from the standard python-pickle batches in --data-dir.

    horovodrun -np 2 python tf_examples/train_cifar10.py --data-dir ~/data/cifar-10-batches-py \\
        --compression dgc:ratio=0.001 --epochs 30

--data-dir holds ``data_batch_1`` ... ``data_batch_5`` and ``test_batch`` (the
"CIFAR-10 python version" archive, unpacked; nothing is downloaded).  Training
images are split across the workers, normalised per channel, randomly flipped
and shifted; the test accuracy is measured after every epoch (the ``curve`` of
the ``--json`` summary, with the training time so far) and reported at the end.
"""

from __future__ import annotations

import time

from _common import choose_device, compression, fit_and_report, init
from models import resnet

from hvd_compress.tools import runtools
from hvd_compress.tools.datasets import cifar10


def main(argv=None):
    ap = runtools.common_parser(__doc__.split("\n\n")[0], epochs=10, batch_size=64, lr=0.05)
    runtools.add_cifar_args(ap)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = choose_device(ap, args)
    try:
        xtr, ytr = cifar10(args.data_dir, train=True)
        xte, yte = cifar10(args.data_dir, train=False)
    except FileNotFoundError as exc:
        raise SystemExit(f"train_cifar10: {exc}") from None
    hvd, keras, tf, hct, label = init(args.seed, device)
    rank, size = hvd.rank(), hvd.size()
    if args.limit_train > 0:
        xtr, ytr = xtr[:args.limit_train], ytr[:args.limit_train]
    xtr, ytr = xtr[rank::size].transpose(0, 2, 3, 1), ytr[rank::size]  # channels last
    xte = xte.transpose(0, 2, 3, 1)
    body = resnet(keras, args.width, args.blocks, 32, 10)
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.RandomFlip("horizontal"),
                              keras.layers.RandomTranslation(0.125, 0.125), body])
    comp = compression(hct, args)
    fit_and_report(args, "train_cifar10", hvd, keras, hct, model, comp, xtr, ytr, xte, yte, t_start,
                   label)


if __name__ == "__main__":
    main()
