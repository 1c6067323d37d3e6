#!/usr/bin/env python
"""Train a small CNN on scikit-learn's bundled 8x8 handwritten digits, sharded across ranks.

    horovodrun -np 2 python torch_examples/train_digits.py --compression topk:ratio=0.01

Real data that ships with scikit-learn (1,797 images; no download): 1,437 for
training, split across the workers, 360 held out for the test accuracy that
rank 0 reports after every epoch (with the training time so far: the ``curve``
of the ``--json`` summary).  With DGC the warm-up follows the epochs.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from _common import finish, make_optimizer, reset_stats, setup, train_epochs

from hvd_compress.tools import runtools
from hvd_compress.tools.datasets import digits_split


class DigitsNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_model(kind: str = "cnn") -> torch.nn.Module:
    """``cnn``: :class:`DigitsNet` (38K parameters); ``wide``: a 10.8M-parameter MLP
    (64 -> 4,096 -> 2,560 -> 10), whose 43 MB of gradients a step make the link matter."""
    if kind == "wide":
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4096), torch.nn.ReLU(),
                                   torch.nn.Linear(4096, 2560), torch.nn.ReLU(),
                                   torch.nn.Linear(2560, 10))
    return DigitsNet()


def load_digits_split(seed: int = 0):
    xtr, ytr, xte, yte = digits_split(seed)
    return (torch.from_numpy(xtr[:, None]), torch.from_numpy(ytr),
            torch.from_numpy(xte[:, None]), torch.from_numpy(yte))


def accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(1)
    model.train()
    return float((pred == y).float().mean())


def main(argv=None):
    ap = runtools.common_parser(__doc__.split("\n\n")[0], epochs=15, batch_size=16, lr=0.02)
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    ap.add_argument("--model", choices=("cnn", "wide"), default="cnn",
                    help="cnn: a small CNN (default); wide: a 10.8M-parameter MLP, for links "
                         "that matter")
    ap.add_argument("--horovod-optimizer", action="store_true",
                    help="use horovod.torch.DistributedOptimizer (summable compressors only)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    rank, size, device = setup(ap, args)
    xtr, ytr, xte, yte = (t.to(device) for t in load_digits_split())
    xtr, ytr = xtr[rank::size], ytr[rank::size]
    model = make_model(args.model).to(device)
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = make_optimizer(model, base, args, args.horovod_optimizer)
    reset_stats(opt)
    steps, images, train_s, acc, curve = train_epochs(
        args, opt, xtr, ytr, lambda xb, yb: F.cross_entropy(model(xb), yb),
        lambda: accuracy(model, xte, yte), f"digits {args.compression} np={size}")
    if rank == 0 and not args.quiet:
        print(f"test accuracy {acc:.4f} after {len(curve)} epochs", flush=True)
    finish(args, "train_digits", steps, images, train_s, opt, acc,
           time.perf_counter() - t_start, epochs=len(curve), curve=curve, device=str(device))


if __name__ == "__main__":
    main()
