"""Helpers the PyTorch examples share: Horovod set-up, the device, the optimizer, the summary."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import horovod.torch as hvd  # noqa: E402

import hvd_compress.torch as hc  # noqa: E402
from hvd_compress import nodes  # noqa: E402
from hvd_compress.tools import devices, runtools  # noqa: E402
from hvd_compress.torch.waiting import wait  # noqa: E402


def init(seed: int):
    """hvd.init() with the node process sets (the hierarchical exchange's, where the
    workers span nodes), one thread per worker when several share a machine, seeds."""
    hvd.init(process_sets=nodes.node_process_sets())
    threads = runtools.worker_threads(hvd.local_size())
    torch.set_num_threads(threads)
    runtools.limit_kernel_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return hvd.rank(), hvd.size()


def setup(ap, args):
    """The example's start: ``--device`` checked first (``cuda`` where PyTorch sees no GPU
    exits here, with one line: before Horovod starts or any data loads), then
    :func:`init` and the device placed.  Returns (rank, size, device): this worker's
    ``torch.device``, GPU ``local_rank % GPUs`` under ``--device cuda``."""
    kind = devices.choose(ap, args, "torch")
    rank, size = init(args.seed)
    return rank, size, place(kind)


def place(kind: str) -> torch.device:
    """This worker's device of ``kind`` (after ``hvd.init()``): the GPU of its local rank,
    modulo the GPUs here (workers may share one), made the current one; or the CPU."""
    if kind != "cuda":
        return torch.device("cpu")
    index = devices.gpu_index(hvd.local_rank(), torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: CUDA runs asynchronously, and a clock read
    without this would time the kernel launches, not the kernels (nothing to do on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_workers(device: torch.device) -> None:
    """Wait until every worker reaches this point (a barrier after ``device``'s queue).

    Before an evaluation, timed: the training time is then the slowest worker's (workers
    that step alone between syncs, as under local SGD and DiLoCo, would wait for it at the
    next sync anyway).  After it, untimed: every worker resumes training together.  So no
    worker evaluates while another trains: on shared cores one worker's evaluation took
    the CPU from another's timed steps, and DiLoCo's syncs then waited 1-11 s for the
    slowed worker (docs/results/adam-era.md).  An allreduce waited for by polling
    (:mod:`hvd_compress.torch.waiting`, unless ``HVD_COMPRESS_WAIT=spin``), not
    ``hvd.barrier``: Horovod's own wait spins, and three spinning workers starved the
    fourth's training for seconds.  Every worker calls it at the same points (none after
    the last evaluation), or they would wait for each other forever."""
    synchronize(device)
    if hvd.size() > 1:
        # (on the training's device: the collectives its steps use)
        wait(hvd.allreduce_async(torch.zeros(1, device=device),
                                 name="hvd_compress.example.all_workers"))


def make_optimizer(model, base, args, horovod_optimizer: bool = False, **options):
    """Our DistributedOptimizer (or Horovod's, for comparison) with broadcast initial state;
    ``options``: more keyword arguments for ours (e.g. DiLoCo's outer optimizer)."""
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if horovod_optimizer:
        if args.local_sgd or args.delay:
            raise SystemExit("--horovod-optimizer has no --local-sgd or --delay")
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=hc.compressor(args.compression),
                                       backward_passes_per_step=args.backward_passes_per_step)
    else:
        opt = hc.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                      compression=args.compression,
                                      backward_passes_per_step=args.backward_passes_per_step,
                                      local_sgd=args.local_sgd,
                                      local_sgd_warmup_steps=args.local_sgd_warmup_steps,
                                      named_buffers=model.named_buffers(), delay=args.delay,
                                      min_numel=args.min_numel, start_step=args.start_step,
                                      hierarchical=runtools.HIERARCHICAL[args.hierarchical],
                                      exchange=args.exchange, **options)
        runtools.print_plan(opt.plan(), args, hvd.rank())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt


def stats_of(opt) -> dict:
    """Summed bytes/time account of our optimizer (zeros for Horovod's own)."""
    return dict(getattr(opt, "comm_totals", {}) or {})


def reset_stats(opt) -> None:
    if hasattr(opt, "comm_totals"):
        for key in opt.comm_totals:
            opt.comm_totals[key] = 0 if key in ("bytes_sent", "collectives") else 0.0


def finish(args, example: str, steps: int, images: int, train_s: float, opt, accuracy,
           wall_s: float, **extra) -> None:
    if hasattr(opt, "drain"):
        opt.drain()  # DGA: collectives still in flight
    if hvd.rank() != 0:
        return
    doc = runtools.summary("torch", example, args.compression, hvd.size(), steps, images,
                           train_s, stats_of(opt), accuracy, wall_s, **runtools.local_fields(args),
                           hierarchical=bool(getattr(opt, "hierarchical", False)),
                           exchange=runtools.exchange_used(opt),
                           exchange_why=runtools.exchange_why(opt), **extra)
    runtools.write_summary(args.json, doc)


def train_epochs(args, opt, x, y, loss_of, evaluate, label, gen=None, after_step=None,
                 log_epochs=False):
    """The epoch loop the training examples share: shuffled micro-batches of
    ``args.batch_size`` of ``x``, ``y`` (on the model's device),
    ``args.backward_passes_per_step`` backward passes per optimizer step, DGC's warm-up
    epoch, a progress display on rank 0 and the test accuracy after every epoch.  Returns
    (steps, images, train_s, accuracy, curve): ``curve`` holds the test accuracy after
    each epoch with the training time so far (:func:`runtools.curve_point`; evaluation
    is not timed).  Under local SGD the epochs before the last evaluate this worker's
    replica (the workers differ until their next average); the last evaluates their
    mean.  With ``--stop-at A`` the loop ends after the first epoch whose accuracy on
    rank 0 (the curve's) is at least A; rank 0 decides and every worker stops with it
    (under local SGD the workers' replicas score differently)."""
    import time

    rank, size = hvd.rank(), hvd.size()
    bpps = runtools.passes_per_step(args)
    per_step = args.batch_size * bpps
    steps_per_epoch = max(1, len(x) // per_step)
    progress = runtools.Progress(steps_per_epoch * args.epochs, label,
                                 enabled=rank == 0 and not args.quiet)
    steps, train_s, acc, curve = 0, 0.0, None, []
    for epoch in range(args.epochs):
        if hasattr(opt, "compression"):
            opt.compression.set_epoch(epoch)
        order = torch.randperm(len(x), generator=gen or torch.Generator().manual_seed(args.seed + epoch))
        order = order.to(x.device)  # (the CPU generator's draws, on the data's device)
        t0 = time.perf_counter()
        for i in range(steps_per_epoch):
            opt.zero_grad()
            for micro in range(bpps):
                idx = order[(i * bpps + micro) * args.batch_size:][:args.batch_size]
                loss = loss_of(x[idx], y[idx]) / bpps
                loss.backward()
            opt.step()
            if after_step is not None:
                after_step()
            steps += 1
            if progress.enabled:  # (reading the loss waits for the device)
                progress.update(steps, f"epoch {epoch + 1} loss {loss.item() * bpps:.3f}"
                                       + (f" acc {acc:.3f}" if acc is not None else ""))
        if epoch == args.epochs - 1 and runtools.needs_final_average(args, steps):
            opt.average_parameters()  # evaluate the mean model, not this worker's
        all_workers(x.device)
        train_s += time.perf_counter() - t0
        acc = evaluate()
        if epoch < args.epochs - 1:
            all_workers(x.device)
        curve.append(runtools.curve_point(epoch + 1, train_s, acc))
        if log_epochs and rank == 0 and not args.quiet:
            print(f"epoch {epoch + 1}: test accuracy {acc:.4f}", flush=True)
        if epoch < args.epochs - 1 and runtools.stop_agreed(
                args, acc, lambda answer: hvd.broadcast_object(answer, 0, name="stop_at")):
            break
    return steps, steps * per_step * size, train_s, acc, curve
