"""Data the examples train on, as numpy arrays (framework-neutral, nothing downloaded).

* :func:`digits_split` -- scikit-learn's bundled 8x8 handwritten digits
  (1,797 images), a fixed split: 1,437 for training, 360 held out.
* :func:`cifar10` -- the CIFAR-10 "python version" batches (``data_batch_1`` ...
  ``data_batch_5``, ``test_batch``) from a folder the user already has.
* :func:`stdlib_text` -- the Python standard library's own source files as bytes, for the
  language-model example (a fixed train/validation split by file), and its windows
  (:func:`lm_batch_starts`: each worker its shard of every step's batch).
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


#: the language-model example's split: every VAL_EVERY-th standard-library file is held out
VAL_EVERY = 10


def stdlib_files() -> list:
    """The Python standard library's own top-level ``*.py`` files, sorted by name: text
    that every machine running these examples has (no download)."""
    import sysconfig
    from pathlib import Path
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stdlib_text(val_every: int = VAL_EVERY, files=None):
    """(train, validation) byte streams (uint8 arrays; a byte-level vocabulary of 256) of
    :func:`stdlib_files` (or ``files``): file i goes to validation when
    ``i % val_every == val_every - 1``, else to training, each stream the files
    concatenated in order.  The same on every worker of a machine, run after run."""
    files = stdlib_files() if files is None else list(files)
    parts: tuple = ([], [])
    for i, path in enumerate(files):
        parts[i % val_every == val_every - 1].append(np.frombuffer(path.read_bytes(), np.uint8))
    train, val = (np.concatenate(p) if p else np.zeros(0, np.uint8) for p in parts)
    return train, val


def lm_batch_starts(n_tokens: int, context: int, batch: int, rank: int, size: int, seed: int,
                    step: int) -> np.ndarray:
    """Where this worker's ``batch`` training windows of step ``step`` start in a stream of
    ``n_tokens`` bytes.  The windows are the stream's non-overlapping stretches of
    ``context + 1`` bytes at multiples of ``context`` (inputs and next-byte targets); each
    step draws ``batch * size`` distinct ones from (seed, step) -- the same draw on every
    worker -- and worker ``rank`` takes the rank-th ``batch`` of them: disjoint shards of one
    global batch, reproducible run after run."""
    windows = (n_tokens - 1) // context
    if windows < batch * size:
        raise ValueError(f"{n_tokens} bytes hold {windows} windows of {context}; a step needs "
                         f"{batch * size}")
    rng = np.random.default_rng([int(seed), int(step)])
    chosen = rng.choice(windows, size=batch * size, replace=False)
    return chosen[rank * batch:(rank + 1) * batch].astype(np.int64) * context


def lm_val_starts(n_tokens: int, context: int, count: int) -> np.ndarray:
    """``count`` fixed validation windows (of ``context + 1`` bytes), spread evenly over a
    stream of ``n_tokens`` bytes (all of them when it holds fewer)."""
    windows = (n_tokens - 1) // context
    return np.unique(np.linspace(0, windows - 1, min(count, windows)).astype(np.int64)) * context
