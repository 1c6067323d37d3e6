#!/usr/bin/env python
"""Train a ResNet on CIFAR-10 from the standard python-pickle batches in --data-dir.

    horovodrun -np 2 python torch_examples/train_cifar10.py --data-dir ~/data/cifar-10-batches-py \\
        --compression dgc:ratio=0.001 --epochs 30

--data-dir holds ``data_batch_1`` ... ``data_batch_5`` and ``test_batch`` (the
"CIFAR-10 python version" archive, unpacked; nothing is downloaded).  Training
images are split across the workers, normalised per channel, with random crops
and flips; rank 0 reports the test accuracy after every epoch (with the
training time so far: the ``curve`` of the ``--json`` summary).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from _common import finish, make_optimizer, reset_stats, setup, train_epochs
from models import resnet

from hvd_compress.tools import runtools
from hvd_compress.tools.datasets import cifar10


def load_batches(data_dir: str, train: bool):
    try:
        x, y = cifar10(data_dir, train)
    except FileNotFoundError as exc:
        raise SystemExit(f"train_cifar10: {exc}") from None
    return torch.from_numpy(x), torch.from_numpy(y)


def augment(x, gen):
    """Random 32x32 crops of the 4-pixel zero-padded images, and horizontal flips."""
    n = x.shape[0]
    padded = F.pad(x, (4, 4, 4, 4))
    dx, dy = torch.randint(0, 9, (2,), generator=gen).tolist()
    out = padded[:, :, dy:dy + 32, dx:dx + 32]
    flip = (torch.rand(n, generator=gen) < 0.5).to(x.device)  # (drawn on the CPU)
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
    runtools.add_cifar_args(ap)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    rank, size, device = setup(ap, args)
    xtr, ytr = load_batches(args.data_dir, train=True)
    xte, yte = load_batches(args.data_dir, train=False)
    if args.limit_train > 0:
        xtr, ytr = xtr[:args.limit_train], ytr[:args.limit_train]
    xtr, ytr = xtr[rank::size].to(device), ytr[rank::size].to(device)
    xte, yte = xte.to(device), yte.to(device)
    model = resnet(args.width, args.blocks, 10).to(device)
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)
    opt = make_optimizer(model, base, args)
    reset_stats(opt)
    steps_per_epoch = max(1, len(xtr) // (args.batch_size * runtools.passes_per_step(args)))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps_per_epoch * args.epochs)
    gen = torch.Generator().manual_seed(args.seed + rank)
    steps, images, train_s, acc, curve = train_epochs(
        args, opt, xtr, ytr, lambda xb, yb: F.cross_entropy(model(augment(xb, gen)), yb),
        lambda: evaluate(model, xte, yte), f"cifar10 {args.compression}", gen=gen,
        after_step=sched.step, log_epochs=True)
    finish(args, "train_cifar10", steps, images, train_s, opt, acc,
           time.perf_counter() - t_start, epochs=len(curve), curve=curve, device=str(device))


if __name__ == "__main__":
    main()
