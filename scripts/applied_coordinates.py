#!/usr/bin/env python
"""How many coordinates a step reach the model: the allgather and the two-phase exchange.

    python scripts/applied_coordinates.py
    python scripts/applied_coordinates.py --np 4 --specs topk:ratio=0.01 topk:ratio=0.02 \\
        --exchange allgather two-phase --seeds 0 1 2 --epochs 15

The allgather applies the union of every worker's selection (up to ``p`` times a sparsifier's
``k``); the two-phase exchange applies what the owners re-select (``k``: Ok-Topk, gTop-k).
This script shows the difference on ``train_digits.py``'s CNN without launching anything:
``--np`` simulated ranks take the example's shards, batch 16 and SGD (0.02, momentum 0.9);
the tensors the per-tensor policy compresses (at least 1,024 values) go through the numpy
core, as the allgather's aggregate (every rank's payload decoded, averaged) or as the
two-phase definition (:func:`hvd_compress.core.twophase.reference`); the others are
averaged dense (all of them with ``none``, the baseline).  The data split, the model's
initial weights and each epoch's order are the example's for the same ``--seed``.

Prints one row per exchange, compression and seed: the test accuracy after the last epoch
and, for each compressed tensor, the mean fraction of its coordinates that are nonzero in
the applied update.  ``--out FILE`` also writes the rows as CSV, with the test accuracy
after each epoch (``curve``).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "torch_examples"))

from hvd_compress.tools import runtools  # noqa: E402

EXCHANGES = ("allgather", "two-phase")
BATCH, LR, MOMENTUM = 16, 0.02, 0.9  # train_digits.py's defaults


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--np", type=int, default=4, help="simulated ranks (default 4)")
    ap.add_argument("--specs", nargs="+", type=runtools.spec_arg, default=["topk:ratio=0.01"],
                    metavar="SPEC", help="compressions (default topk:ratio=0.01)")
    ap.add_argument("--exchange", nargs="+", choices=EXCHANGES, default=list(EXCHANGES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--epochs", type=runtools.positive_int, default=15,
                    help="default 15, as the example")
    ap.add_argument("--out", help="also write the rows to this CSV file")
    return ap


def run(p: int, spec: str, exchange: str, seed: int, epochs: int) -> dict:
    """Train the simulated ranks; the row: accuracy and each compressed tensor's fraction."""
    import torch
    import torch.nn.functional as F
    from train_digits import accuracy, load_digits_split, make_model

    from hvd_compress.core.policy import DEFAULT_MIN_NUMEL
    from hvd_compress.core.registry import build
    from hvd_compress.core.twophase import reference, takes_two_phase

    torch.manual_seed(seed)  # as the example: its split is seed 0's, its model and order the seed's
    xtr, ytr, xte, yte = load_digits_split()
    shards = [(xtr[r::p], ytr[r::p]) for r in range(p)]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    comps = [build(spec, rank=r, world_size=p) for r in range(p)]
    params = dict(model.named_parameters())
    packed = [n for n, t in params.items() if t.numel() >= DEFAULT_MIN_NUMEL
              and takes_two_phase(comps[0], tuple(t.shape), p)]
    if not packed and spec != "none":
        raise SystemExit(f"{spec}: no tensor of the model goes two-phase at np {p} "
                         "(a summable or pass-through compression)")
    steps = min(len(x) // BATCH for x, _ in shards)
    nonzero = {n: [] for n in packed}
    curve = []
    for epoch in range(epochs):
        order = [torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
                 for x, _ in shards]
        for i in range(steps):
            grads = []
            for r, (x, y) in enumerate(shards):
                at = order[r][i * BATCH:][:BATCH]
                model.zero_grad()
                F.cross_entropy(model(x[at]), y[at]).backward()
                grads.append({n: t.grad.numpy().astype(np.float32) for n, t in params.items()})
            mean = {n: sum(g[n] for g in grads) / p for n in params if n not in packed}
            if exchange == "allgather":
                for n in packed:  # every rank's payload, summed as the flat engine sums them
                    sent = [comp.encode(grads[r][n].reshape(-1), n) for r, comp in enumerate(comps)]
                    total = comps[0].aggregate([e.payload for e in sent], sent[0])
                    mean[n] = np.reshape(np.asarray(total) / p, grads[0][n].shape)
            else:
                mean.update(zip(packed, reference(comps, [[g[n] for n in packed] for g in grads],
                                                  packed)))
            for n in packed:
                nonzero[n].append(np.count_nonzero(mean[n]) / mean[n].size)
            for n, t in params.items():
                t.grad = torch.from_numpy(np.ascontiguousarray(mean[n], dtype=np.float32))
            opt.step()
        curve.append(round(accuracy(model, xte, yte), 4))
    row = {"exchange": "dense" if spec == "none" else exchange, "compression": spec, "np": p,
           "seed": seed, "test_accuracy": curve[-1], "curve": " ".join(map(str, curve))}
    row.update({f"applied:{n}": round(float(np.mean(v)), 5) for n, v in nonzero.items()})
    return row


def main(argv=None) -> list:
    args = parser().parse_args(argv)
    if args.np < 2:
        raise SystemExit("--np must be at least 2")
    rows = []
    for spec in args.specs:
        for exchange in (["dense"] if spec == "none" else args.exchange):
            for seed in args.seeds:
                row = run(args.np, spec, exchange, seed, args.epochs)
                rows.append(row)
                shares = "  ".join(f"{k.split(':', 1)[1]} {100 * v:.2f}%"
                                   for k, v in row.items() if k.startswith("applied:"))
                print(f"{exchange:9s} {spec:18s} seed {seed}: accuracy "
                      f"{100 * row['test_accuracy']:.2f}%  applied a step: {shares}", flush=True)
    if args.out:
        with open(args.out, "w", newline="") as f:
            names = list(dict.fromkeys(k for row in rows for k in row))
            w = csv.DictWriter(f, fieldnames=names, restval="")
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
