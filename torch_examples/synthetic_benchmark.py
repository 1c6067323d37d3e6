#!/usr/bin/env python
"""Horovod's synthetic benchmark, with compression: images/s of a ResNet on random data.

    horovodrun -np 2 python torch_examples/synthetic_benchmark.py --compression topk:ratio=0.01

The shape of Horovod's ``pytorch_synthetic_benchmark.py``: a model, one random
batch, ``--num-warmup-batches`` untimed steps, then ``--num-iters`` timed
iterations of ``--num-batches-per-iter`` steps; images/s per worker and in
total, with the mean and 95% interval over iterations.  The default ResNet is
small enough for 2-core machines (``--width``/``--blocks``/``--image-size`` make
it bigger).  ``--horovod-optimizer`` runs the same step with Horovod's own
optimizer, for comparing the overhead of ours.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from _common import finish, make_optimizer, reset_stats, setup, synchronize
from models import resnet

from hvd_compress.tools import runtools


def main(argv=None):
    ap = runtools.common_parser(__doc__.split("\n\n")[0], batch_size=32, lr=0.01)
    runtools.add_synthetic_args(ap)
    ap.add_argument("--horovod-optimizer", action="store_true",
                    help="use horovod.torch.DistributedOptimizer (summable compressors only)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    rank, size, device = setup(ap, args)
    model = resnet(args.width, args.blocks, args.num_classes).to(device)
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = make_optimizer(model, base, args, args.horovod_optimizer)
    if hasattr(opt, "compression"):
        runtools.past_warmup(opt.compression)
    g = torch.Generator().manual_seed(args.seed + rank)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g).to(device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), generator=g).to(device)
    bpps = runtools.passes_per_step(args)
    nparams = sum(p.numel() for p in model.parameters())

    def step():
        opt.zero_grad()
        for _ in range(bpps):
            loss = F.cross_entropy(model(data), target) / bpps
            loss.backward()
        opt.step()

    if rank == 0 and not args.quiet:
        print(f"model: ResNet width {args.width} blocks {args.blocks}, {nparams:,} parameters; "
              f"batch {args.batch_size} x {bpps} per step; {size} workers; "
              f"compression {args.compression}" + (f"; on {device}" if device.type != "cpu" else "")
              + (" (Horovod's optimizer)" if args.horovod_optimizer else ""), flush=True)
    for _ in range(args.num_warmup_batches):
        step()
    synchronize(device)
    reset_stats(opt)
    progress = runtools.Progress(args.num_iters, "iterations", enabled=rank == 0 and not args.quiet)
    rates, train_s = [], 0.0
    for it in range(args.num_iters):
        t0 = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        synchronize(device)
        dt = time.perf_counter() - t0
        train_s += dt
        rates.append(args.batch_size * bpps * args.num_batches_per_iter / dt)
        progress.update(it + 1, f"{rates[-1]:.1f} img/s per worker")
    mean, conf = float(np.mean(rates)), 1.96 * float(np.std(rates))
    if rank == 0 and not args.quiet:
        print(f"img/sec per worker: {mean:.1f} +-{conf:.1f}", flush=True)
        print(f"total img/sec on {size} workers: {size * mean:.1f} +-{size * conf:.1f}", flush=True)
    steps = args.num_iters * args.num_batches_per_iter
    images = steps * args.batch_size * bpps * size
    finish(args, "synthetic_benchmark", steps, images, train_s, opt, None,
           time.perf_counter() - t_start, parameters=nparams,
           horovod_optimizer=bool(args.horovod_optimizer),
           img_sec_per_worker_mean=round(mean, 2), img_sec_per_worker_conf=round(conf, 2),
           device=str(device))


if __name__ == "__main__":
    main()
