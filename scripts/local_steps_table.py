#!/usr/bin/env python
"""Accuracy and bytes per epoch of local SGD (period H) and DGA (delay D) on the digits example.

    python scripts/local_steps_table.py --out results/local_steps
    python scripts/local_steps_table.py --out r --framework torch tensorflow --periods 1 2 4 8 \\
        --delays 0 2 4 --compression none topk:ratio=0.01

Each row is a real ``horovodrun -np N`` launch of ``train_digits.py`` (launched
as hvd-compress-compare launches its runs); D = 0 is ordinary synchronous
training, the baseline.  Writes ``local_steps.csv`` and ``local_steps.md`` and
prints the table.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_compress import spec as specmod  # noqa: E402
from hvd_compress.localsteps import check_local_args  # noqa: E402
from hvd_compress.tools import compare, runtools  # noqa: E402

COLUMNS = ["framework", "compression", "mode", "np", "epochs", "test_accuracy", "bytes_per_epoch",
           "bytes_vs_sync", "images_per_sec", "wall_s", "status"]


def variants(args) -> list[tuple[str, str]]:
    """(mode label, extra flags) per row: DGA delays (D=0 is synchronous), then periods."""
    out = [("sync" if d == 0 else f"DGA D={d}", f"--delay {d}" if d else "") for d in args.delays]
    out += [(f"local SGD H={h}", f"--local-sgd --backward-passes-per-step {h}")
            for h in args.periods]
    return out


def run_one(args, framework, spec, mode, flags, out: Path) -> dict:
    sub = out / "".join(c if c.isalnum() else "_" for c in mode)
    launch = SimpleNamespace(example_args=f"--epochs {args.epochs} {flags}", timeout=args.timeout)
    run = {"framework": framework, "example": "digits", "compression": spec, "np": args.np,
           "bandwidth": compare.UNCAPPED, "latency": ""}
    row = compare.execute(launch, run, sub)
    ok = row["status"] == "ok"
    steps = float(row.get("steps") or 0)
    per_epoch = float(row.get("bytes_per_step") or 0) * steps / args.epochs if ok else None
    return {"framework": framework, "compression": spec, "mode": mode, "np": args.np,
            "epochs": args.epochs, "test_accuracy": row.get("test_accuracy"),
            "bytes_per_epoch": None if per_epoch is None else int(round(per_epoch)),
            "images_per_sec": row.get("images_per_sec"), "wall_s": row.get("wall_s"),
            "status": row["status"]}


def markdown(rows: list[dict]) -> str:
    lines = ["| framework | compression | mode | test accuracy | bytes/epoch/worker | vs sync | "
             "img/s | wall s |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['framework']} | {r['compression']} | {r['mode']} | "
                         f"{r['status']} | | | | |")
            continue
        vs = f"{r['bytes_vs_sync']:.3f}" if r.get("bytes_vs_sync") is not None else ""
        lines.append(f"| {r['framework']} | {r['compression']} | {r['mode']} | "
                     f"{float(r['test_accuracy']):.4f} | {r['bytes_per_epoch']:,} | {vs} | "
                     f"{float(r['images_per_sec']):.0f} | {float(r['wall_s']):.1f} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = runtools.script_parser(__doc__)
    ap.add_argument("--framework", nargs="+", choices=["torch", "tensorflow"], default=["torch"])
    ap.add_argument("--compression", nargs="+", type=runtools.spec_arg, default=["none"],
                    metavar="SPEC", help="compressor specs (default none)")
    ap.add_argument("--periods", nargs="*", type=runtools.positive_int, default=[1, 2, 4, 8],
                    metavar="H", help="local SGD averaging periods (default 1 2 4 8)")
    ap.add_argument("--delays", nargs="*", type=runtools.nonnegative_int, default=[0, 2, 4],
                    metavar="D", help="DGA delays, 0 = synchronous (default 0 2 4)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if not args.periods and not args.delays:
        ap.error("give at least one --periods or --delays value")
    for spec in args.compression:  # the optimizers' own rule for DGA, before any launch
        for delay in args.delays:
            try:
                check_local_args(False, 1, 0, delay, True, specmod.parse(spec))
            except ValueError as exc:
                ap.error(f"{spec}: {exc}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = [(fw, spec, mode, flags) for fw in args.framework for spec in args.compression
            for mode, flags in variants(args)]
    progress = runtools.Progress(len(plan), "local steps", enabled=not args.quiet)
    rows = []
    for i, (fw, spec, mode, flags) in enumerate(plan):
        rows.append(run_one(args, fw, spec, mode, flags, out))
        progress.update(i + 1, f"{fw} {spec} {mode}: {rows[-1]['status']}")
    for r in rows:  # bytes relative to synchronous training of the same framework and spec
        base = next((b for b in rows if b["mode"] == "sync" and b["framework"] == r["framework"]
                     and b["compression"] == r["compression"] and b["bytes_per_epoch"]), None)
        r["bytes_vs_sync"] = (r["bytes_per_epoch"] / base["bytes_per_epoch"]
                              if base and r["bytes_per_epoch"] is not None else None)
    with open(out / "local_steps.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    table = markdown(rows)
    (out / "local_steps.md").write_text(table)
    print(table, end="")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
