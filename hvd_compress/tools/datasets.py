"""Data the examples train on, as numpy arrays (framework-neutral, nothing downloaded).

* :func:`digits_split` -- scikit-learn's bundled 8x8 handwritten digits
  (1,797 images), a fixed split: 1,437 for training, 360 held out.
* :func:`cifar10` -- the CIFAR-10 "python version" batches (``data_batch_1`` ...
  ``data_batch_5``, ``test_batch``) from a folder the user already has.
"""

from __future__ import annotations

import os
import pickle

import numpy as np

CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32)
CIFAR_STD = np.array([0.2470, 0.2435, 0.2616], np.float32)


def digits_split(seed: int = 0):
    """(x_train, y_train, x_test, y_test): images in [0, 1], shape (N, 8, 8), int64 labels."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def cifar10(data_dir: str, train: bool):
    """Normalised images (N, 3, 32, 32) float32 and int64 labels from the python batches."""
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    xs, ys = [], []
    for name in names:
        path = os.path.join(data_dir, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found; the folder must hold the CIFAR-10 python "
                                    "batches (data_batch_1..5, test_batch)")
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        xs.append(np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(batch[b"labels"], np.int64))
    x = np.concatenate(xs).astype(np.float32) / 255.0
    x = (x - CIFAR_MEAN.reshape(1, 3, 1, 1)) / CIFAR_STD.reshape(1, 3, 1, 1)
    return x, np.concatenate(ys)
