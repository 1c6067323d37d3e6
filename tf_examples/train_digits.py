#!/usr/bin/env python
"""Keras ``fit`` of a small CNN on scikit-learn's bundled 8x8 digits, sharded across ranks.

    horovodrun -np 2 python tf_examples/train_digits.py --compression topk:ratio=0.01

The same data and split as torch_examples/train_digits.py (1,437 training images
split across the workers, 360 held out); the model is compiled with
``hvd_compress.tensorflow.keras.DistributedOptimizer``.  With DGC the warm-up
epoch is set by a callback; another evaluates after every epoch (the ``curve`` of
the ``--json`` summary).

``--strategy mwms`` trains the same model on the same shards with TensorFlow's
MultiWorkerMirroredStrategy instead of Horovod (the baseline; ``tf_examples/_mwms.py``):

    python -m hvd_compress.tools.mwms -np 2 python tf_examples/train_digits.py --strategy mwms
"""

from __future__ import annotations

import time

import _mwms
from _common import choose_device, compression, fit_and_report, init

from hvd_compress.tools import runtools
from hvd_compress.tools.datasets import digits_split


def make_model(keras, kind: str = "cnn"):
    """``cnn``: the small CNN (38K parameters); ``wide``: a 10.8M-parameter MLP
    (64 -> 4,096 -> 2,560 -> 10), whose 43 MB of gradients a step make the link matter,
    initialised as torch's ``nn.Linear`` (weights and biases uniform in
    ±1/sqrt(fan_in)): the same model as torch_examples/train_digits.py's, which the
    MultiWorkerMirroredStrategy baseline is compared with (Keras's Glorot default
    starts it elsewhere)."""
    if kind == "wide":
        def dense(units, fan_in, **kw):
            bound = fan_in ** -0.5
            init = keras.initializers.RandomUniform
            return keras.layers.Dense(units, kernel_initializer=init(-bound, bound),
                                      bias_initializer=init(-bound, bound), **kw)
        return keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Flatten(),
            dense(4096, 64, activation="relu"), dense(2560, 4096, activation="relu"), dense(10, 2560)])
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def main(argv=None):
    ap = runtools.common_parser(__doc__.split("\n\n")[0], epochs=15, batch_size=16, lr=0.02)
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    ap.add_argument("--model", choices=("cnn", "wide"), default="cnn",
                    help="cnn: a small CNN (default); wide: a 10.8M-parameter MLP, for links "
                         "that matter")
    ap.add_argument("--strategy", choices=("horovod", "mwms"), default="horovod",
                    help="horovod (default), or mwms: TensorFlow's MultiWorkerMirroredStrategy, "
                         "launched by python -m hvd_compress.tools.mwms (--compression none)")
    args = ap.parse_args(argv)
    if args.strategy == "mwms":  # what it refuses, at once (before TensorFlow loads)
        _mwms.check_args(ap, args)
        _mwms.check_launched()
    t_start = time.perf_counter()
    device = choose_device(ap, args)
    data = [a[..., None] if a.ndim == 3 else a for a in digits_split()]
    if args.strategy == "mwms":
        strategy, rank, size, label = _mwms.strategy_and_world(device)
        xtr, ytr, xte, yte = data
        steps = -(-(len(xtr) // size) // args.batch_size)  # Keras fit's count on the smaller shard
        _mwms.fit_and_report(args, "train_digits", strategy, rank, size,
                             lambda keras: make_model(keras, args.model),
                             xtr[rank::size], ytr[rank::size], xte, yte, steps, t_start, label)
        return
    hvd, keras, tf, hct, label = init(args.seed, device)
    rank, size = hvd.rank(), hvd.size()
    xtr, ytr, xte, yte = data
    xtr, ytr = xtr[rank::size], ytr[rank::size]
    comp = compression(hct, args)
    fit_and_report(args, "train_digits", hvd, keras, hct, make_model(keras, args.model), comp, xtr,
                   ytr, xte, yte, t_start, label)


if __name__ == "__main__":
    main()
