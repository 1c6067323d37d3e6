#!/usr/bin/env python
"""Train a ResNet on CIFAR-10 from the standard python-pickle batches in --data-dir.

    horovodrun -np 2 python torch_examples/train_cifar10.py --data-dir ~/data/cifar-10-batches-py \\
        --compression dgc:ratio=0.001 --epochs 30

--data-dir holds ``data_batch_1`` ... ``data_batch_5`` and ``test_batch`` (the
"CIFAR-10 python version" archive, unpacked; nothing is downloaded).  Training
images are split across the workers, normalised per channel, with random crops
and flips; rank 0 reports the test accuracy after every epoch.
"""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import torch
import torch.nn.functional as F
from _common import finish, init, make_optimizer, reset_stats, train_epochs
from models import resnet

from hvd_compress import runtools

MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32).reshape(1, 3, 1, 1)
STD = np.array([0.2470, 0.2435, 0.2616], np.float32).reshape(1, 3, 1, 1)


def load_batches(data_dir: str, names):
    xs, ys = [], []
    for name in names:
        path = os.path.join(data_dir, name)
        if not os.path.exists(path):
            raise SystemExit(f"train_cifar10: {path} not found; --data-dir must hold the CIFAR-10 "
                             "python batches (data_batch_1..5, test_batch)")
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        xs.append(np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(batch[b"labels"], np.int64))
    x = (np.concatenate(xs).astype(np.float32) / 255.0 - MEAN) / STD
    return torch.from_numpy(x), torch.from_numpy(np.concatenate(ys))


def augment(x, gen):
    """Random 32x32 crops of the 4-pixel zero-padded images, and horizontal flips."""
    n = x.shape[0]
    padded = F.pad(x, (4, 4, 4, 4))
    dx, dy = torch.randint(0, 9, (2,), generator=gen).tolist()
    out = padded[:, :, dy:dy + 32, dx:dx + 32]
    flip = torch.rand(n, generator=gen) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


def evaluate(model, x, y, batch=500) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            correct += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    model.train()
    return correct / max(1, len(x))


def main(argv=None):
    ap = runtools.common_parser(__doc__.split("\n\n")[0], epochs=10, batch_size=64, lr=0.05)
    ap.add_argument("--data-dir", required=True, help="folder with the CIFAR-10 python batches")
    ap.add_argument("--width", type=runtools.positive_int, default=16)
    ap.add_argument("--blocks", type=runtools.positive_int, nargs="+", default=[1, 1, 1])
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--limit-train", type=int, default=0,
                    help="use only the first N training images (0: all)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    rank, size = init(args.seed)
    xtr, ytr = load_batches(args.data_dir, [f"data_batch_{i}" for i in range(1, 6)])
    xte, yte = load_batches(args.data_dir, ["test_batch"])
    if args.limit_train > 0:
        xtr, ytr = xtr[:args.limit_train], ytr[:args.limit_train]
    xtr, ytr = xtr[rank::size], ytr[rank::size]
    model = resnet(args.width, args.blocks, 10)
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)
    opt = make_optimizer(model, base, args)
    reset_stats(opt)
    steps_per_epoch = max(1, len(xtr) // (args.batch_size * args.backward_passes_per_step))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps_per_epoch * args.epochs)
    gen = torch.Generator().manual_seed(args.seed + rank)
    steps, images, train_s, acc = train_epochs(
        args, opt, xtr, ytr, lambda xb, yb: F.cross_entropy(model(augment(xb, gen)), yb),
        lambda: evaluate(model, xte, yte), f"cifar10 {args.compression}", gen=gen,
        after_step=sched.step, log_epochs=True)
    finish(args, "train_cifar10", steps, images, train_s, opt, acc,
           time.perf_counter() - t_start, epochs=args.epochs)


if __name__ == "__main__":
    main()
