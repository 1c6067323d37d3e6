#!/usr/bin/env python
"""Train a small decoder-only transformer language model on the Python standard library's own
source files (bytes), with AdamW, 1-bit Adam, 0/1 Adam or DiLoCo.

    horovodrun -np 2 python torch_examples/train_lm.py                         # dense AdamW
    horovodrun -np 2 python torch_examples/train_lm.py --compression topk:ratio=0.01
    horovodrun -np 2 python torch_examples/train_lm.py --optimizer onebit-adam \\
        --compression efsignsgd --exchange two-phase --freeze-step 100
    horovodrun -np 2 python torch_examples/train_lm.py --diloco 50 --target-loss 2.2

Text every machine has, nothing downloaded: the standard library's top-level ``*.py``
files in name order, every tenth held out for validation (``hvd_compress.tools.datasets``),
read byte by byte (a vocabulary of 256).  Every step draws one global batch of windows of
``--context`` bytes and each worker trains on its own share of it.  The model
(``models.TinyLM``: GPT-2's layout, 4 layers of width 128 by default, 0.8M parameters)
learns to predict each next byte.  Optimizers: ``adamw`` (``torch.optim.AdamW``, its
gradients exchanged with ``--compression``, dense with ``none``); ``onebit-adam`` (1-bit
Adam, Tang et al. 2021: dense Adam for ``--freeze-step`` steps, then the variance frozen and
the momentum sent compressed with error feedback) and ``zeroone-adam`` (0/1 Adam, Lu et al.
2022: the variance frozen adaptively, rounds skipped) -- both want a 1-bit compressor
(``efsignsgd``) and the two-phase exchange; ``--diloco H`` (Douillard et al. 2023): AdamW
steps locally and every H steps an outer Nesterov step (``--outer-lr``, ``--outer-momentum``)
applies the workers' averaged change, ``--fragments F`` syncing one of F fragments of the
parameters at a time (Streaming DiLoCo).  Rank 0 reports the validation loss every
``--eval-every`` steps with the training time so far (the summary's ``curve``; evaluation
is not timed), the loss of every step, tokens/s, bytes a step and, with ``--target-loss
L``, the training time until the validation loss first reached L.
"""

from __future__ import annotations

import inspect
import math
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from _common import all_workers, finish, make_optimizer, reset_stats, setup
from models import TinyLM

import hvd_compress.torch as hc
from hvd_compress.localsteps import check_local_args, check_outer_args
from hvd_compress.tools import runtools
from hvd_compress.tools.datasets import lm_batch_starts, lm_val_starts, stdlib_text

OPTIMIZERS = ("adamw", "onebit-adam", "zeroone-adam")
#: what each optimizer needs of hvd_compress.torch (the Adam-family classes: their papers')
CLASSES = {"onebit-adam": "OneBitAdam", "zeroone-adam": "ZeroOneAdam"}
#: DiLoCo's keywords of hc.DistributedOptimizer
DILOCO_KEYWORDS = ("outer_lr", "outer_momentum", "fragments")


def parser():
    ap = runtools.common_parser(__doc__.split("\n\n")[0], steps=600, batch_size=16, lr=3e-3)
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                    help="adamw (default): AdamW, its gradients exchanged with --compression; "
                         "onebit-adam: 1-bit Adam; zeroone-adam: 0/1 Adam (both with a 1-bit "
                         "--compression such as efsignsgd and --exchange two-phase)")
    ap.add_argument("--weight-decay", type=float, default=0.01,
                    help="decoupled weight decay (default 0.01)")
    ap.add_argument("--warmup-steps", type=runtools.nonnegative_int, default=20, metavar="N",
                    help="learning rate rising linearly over the first N steps (default 20)")
    ap.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                    help="after the warm-up: constant (default), or cosine decay to a tenth "
                         "of --lr at the last step (DiLoCo's inner schedule)")
    ap.add_argument("--freeze-step", type=runtools.positive_int, default=100, metavar="N",
                    help="1-bit Adam: dense Adam steps before the variance is frozen; 0/1 Adam: "
                         "its var_freeze_step, the last step that may update the variance "
                         "(default 100)")
    ap.add_argument("--local-step-clipper", type=runtools.positive_int, default=16, metavar="N",
                    help="0/1 Adam: the longest interval of local steps (default 16)")
    ap.add_argument("--local-step-scaler", type=runtools.positive_int, default=32678,
                    metavar="N", help="0/1 Adam: local steps before their interval doubles "
                    "(default 32678, DeepSpeed's, for runs of 100k+ steps)")
    ap.add_argument("--var-update-scaler", type=runtools.positive_int, default=16, metavar="N",
                    help="0/1 Adam: variance updates before their interval doubles (default 16)")
    ap.add_argument("--diloco", type=runtools.positive_int, default=None, metavar="H",
                    help="DiLoCo: AdamW steps locally, every H steps an outer Nesterov step on the "
                         "workers' averaged change (its --compression with error feedback)")
    ap.add_argument("--outer-lr", type=float, default=0.7,
                    help="DiLoCo's outer learning rate (default 0.7, the paper's)")
    ap.add_argument("--outer-momentum", type=float, default=0.9,
                    help="DiLoCo's outer Nesterov momentum (default 0.9, the paper's)")
    ap.add_argument("--fragments", type=runtools.positive_int, default=1, metavar="F",
                    help="with --diloco: Streaming DiLoCo, the parameters in F fragments synced "
                         "in turn (default 1: all at once)")
    ap.add_argument("--context", type=runtools.positive_int, default=64, help="bytes a window (default 64)")
    ap.add_argument("--d-model", type=runtools.positive_int, default=128, help="width (default 128)")
    ap.add_argument("--layers", type=runtools.positive_int, default=4, help="blocks (default 4)")
    ap.add_argument("--heads", type=runtools.positive_int, default=4, help="attention heads (default 4)")
    ap.add_argument("--eval-every", type=runtools.positive_int, default=50, metavar="N",
                    help="validation loss every N steps and after the last (default 50)")
    ap.add_argument("--val-windows", type=runtools.positive_int, default=256, metavar="N",
                    help="validation windows, spread over the held-out files (default 256)")
    ap.add_argument("--target-loss", type=float, default=None, metavar="L",
                    help="report the training time and steps until the validation loss first "
                         "reached L (nats a byte)")
    ap.add_argument("--stop-at-target", action="store_true",
                    help="with --target-loss: stop at the first evaluation that reaches it "
                         "(rank 0's validation loss decides for every worker)")
    return ap


def usage_error(ap, message: str):
    """Exit with status 2 and one line (before Horovod or any data)."""
    ap.exit(2, f"{ap.prog}: error: {message}\n")


def check_args(ap, args) -> dict:
    """What the flags ask of the optimizers, checked before anything starts; returns the
    DiLoCo keywords for ``hc.DistributedOptimizer`` ({} without --diloco).  A choice whose
    class or keyword ``hvd_compress.torch`` lacks is refused with a line naming it."""
    if args.target_loss is not None and not (math.isfinite(args.target_loss) and args.target_loss > 0):
        usage_error(ap, f"--target-loss is a loss > 0 (nats a byte), got {args.target_loss:g}")
    if args.stop_at_target and args.target_loss is None:
        usage_error(ap, "--stop-at-target needs --target-loss L")
    if args.d_model % args.heads:
        usage_error(ap, f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    name = CLASSES.get(args.optimizer)
    if name and not hasattr(hc, name):
        usage_error(ap, f"--optimizer {args.optimizer} needs hvd_compress.torch.{name}, which "
                        "this version does not have")
    if args.fragments > 1 and args.diloco is None:
        usage_error(ap, "--fragments needs --diloco H")
    if args.diloco is None:
        return {}
    if name:
        usage_error(ap, f"--diloco runs AdamW inside; it does not combine with --optimizer "
                        f"{args.optimizer}")
    if args.local_sgd or args.delay or args.backward_passes_per_step != 1:
        usage_error(ap, "--diloco H sets the period itself: no --local-sgd, --delay or "
                        "--backward-passes-per-step with it")
    params = inspect.signature(hc.DistributedOptimizer).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [k for k in DILOCO_KEYWORDS if k not in params and not takes_any]
    if missing:
        usage_error(ap, "--diloco needs hvd_compress.torch.DistributedOptimizer's "
                        f"{', '.join(missing)}, which this version does not have")
    try:  # what local SGD and the outer step refuse (a compressor, a period), as usage errors
        from hvd_compress.core import policy
        for spec in policy.Policy(args.compression).known_specs() or [None]:
            check_local_args(True, args.diloco, 0, 0, True, spec)
        check_outer_args(True, args.outer_lr, args.outer_momentum, args.fragments, args.diloco)
    except ValueError as exc:
        usage_error(ap, f"--diloco: {exc}")
    args.local_sgd, args.backward_passes_per_step = True, args.diloco  # DiLoCo is local SGD
    return {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
            "fragments": args.fragments}


def make_base(args, model):
    """The optimizer each worker steps with (wrapped by hc.DistributedOptimizer)."""
    params = model.parameters()
    if args.optimizer == "onebit-adam":
        return hc.OneBitAdam(params, lr=args.lr, weight_decay=args.weight_decay,
                             freeze_step=args.freeze_step)
    if args.optimizer == "zeroone-adam":
        return hc.ZeroOneAdam(params, lr=args.lr, weight_decay=args.weight_decay,
                              var_freeze_step=args.freeze_step,
                              local_step_clipper=args.local_step_clipper,
                              local_step_scaler=args.local_step_scaler,
                              var_update_scaler=args.var_update_scaler)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)


def windows(stream: torch.Tensor, starts, context: int):
    """Inputs and next-byte targets (batch, context) of the windows at ``starts``."""
    idx = torch.as_tensor(starts, device=stream.device)[:, None] + torch.arange(
        context + 1, device=stream.device)
    w = stream[idx].long()
    return w[:, :-1], w[:, 1:]


def lm_loss(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, model.head.out_features), y.reshape(-1))


def validation_loss(model, val: torch.Tensor, starts, context: int, batch: int = 64) -> float:
    """The mean next-byte cross-entropy (nats) over the validation windows."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(starts), batch):
            x, y = windows(val, starts[i:i + batch], context)
            total += lm_loss(model, x, y).item() * y.numel()
            count += y.numel()
    model.train()
    return total / max(1, count)


def lr_at(args, step: int) -> float:
    """The learning rate of step ``step`` (0-based): linear warm-up over
    ``--warmup-steps``, then constant or (``--lr-schedule cosine``) a half cosine from
    ``--lr`` down to ``--lr / 10`` at the last step."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.lr
    span = max(1, args.steps - 1 - args.warmup_steps)
    done = min(1.0, (step - args.warmup_steps) / span)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * done)))


def train(args, model, opt, train_stream, val_stream, val_starts):
    """The step loop: returns (steps, train_s, losses, curve, reached) -- ``curve`` the
    validation loss after every ``--eval-every`` steps and the last (step, training
    seconds, val_loss, train_loss: the mean of the steps since the point before),
    ``reached`` its first point at or below ``--target-loss`` (None)."""
    rank, size, device = hvd.rank(), hvd.size(), train_stream.device
    progress = runtools.Progress(args.steps, f"lm {args.optimizer} {args.compression} np={size}",
                                 enabled=rank == 0 and not args.quiet)
    losses, curve, reached, train_s, steps = [], [], None, 0.0, 0
    since = 0
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        x, y = windows(train_stream, lm_batch_starts(len(train_stream), args.context,
                                                     args.batch_size, rank, size, args.seed, step),
                       args.context)
        opt.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        steps += 1
        losses.append(round(loss.detach().item(), 4))  # (waits for the device: the step is done)
        progress.update(steps, f"loss {losses[-1]:.3f}")
        if steps % args.eval_every and steps != args.steps:
            continue
        if steps == args.steps and (runtools.needs_final_average(args, steps) or args.fragments > 1):
            opt.average_parameters()  # evaluate the mean model, not this worker's (Streaming
            # DiLoCo's fragments sync at different steps: at a multiple of H too)
        all_workers(device)  # (timed: the slowest worker's steps count)
        train_s += time.perf_counter() - t0
        val = validation_loss(model, val_stream, val_starts, args.context)
        if steps < args.steps:
            all_workers(device)  # (untimed: no worker trains while another evaluates)
        curve.append({"step": steps, "seconds": round(train_s, 3), "val_loss": round(val, 4),
                      "train_loss": round(float(np.mean(losses[since:])), 4)})
        since = len(losses)
        if rank == 0 and not args.quiet:
            print(f"step {steps}: validation loss {val:.4f}", flush=True)
        if reached is None and args.target_loss is not None and val <= args.target_loss:
            reached = curve[-1]
        if args.stop_at_target and steps < args.steps and hvd.broadcast_object(
                reached is not None, 0, name="stop_at_loss"):
            break
        t0 = time.perf_counter()
    return steps, train_s, losses, curve, reached


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    diloco = check_args(ap, args)
    t_start = time.perf_counter()
    rank, size, device = setup(ap, args)
    train_bytes, val_bytes = stdlib_text()
    train_stream = torch.from_numpy(train_bytes).to(device)
    val_stream = torch.from_numpy(val_bytes).to(device)
    val_starts = lm_val_starts(len(val_bytes), args.context, args.val_windows)
    model = TinyLM(256, args.context, args.d_model, args.layers, args.heads).to(device)
    opt = make_optimizer(model, make_base(args, model), args, **diloco)
    reset_stats(opt)
    steps, train_s, losses, curve, reached = train(args, model, opt, train_stream, val_stream,
                                                   val_starts)
    tokens = steps * args.batch_size * args.context * size
    if rank == 0 and not args.quiet:
        print(f"validation loss {curve[-1]['val_loss']:.4f} after {steps} steps, "
              f"{tokens / max(train_s, 1e-9):.0f} tokens/s", flush=True)
    finish(args, "train_lm", steps, tokens, train_s, opt, None, time.perf_counter() - t_start,
           curve=curve, device=str(device), optimizer=args.optimizer, lr=args.lr,
           lr_schedule=args.lr_schedule,
           diloco=args.diloco, fragments=args.fragments,
           outer_lr=args.outer_lr if args.diloco else None,
           outer_momentum=args.outer_momentum if args.diloco else None,
           parameters=sum(p.numel() for p in model.parameters()),
           tokens_per_step=args.batch_size * args.context * size,
           tokens_per_sec=round(tokens / train_s, 2) if train_s > 0 else 0.0,
           val_loss=curve[-1]["val_loss"], train_loss=curve[-1]["train_loss"],
           loss_per_step=losses, target_loss=args.target_loss,
           time_to_target_s=reached["seconds"] if reached else None,
           steps_to_target=reached["step"] if reached else None,
           train_bytes=len(train_bytes), val_bytes=len(val_bytes))


if __name__ == "__main__":
    main()
