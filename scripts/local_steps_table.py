#!/usr/bin/env python
"""Accuracy and bytes per epoch of local SGD (period H) and DGA (delay D) on the digits example.

    python scripts/local_steps_table.py --out results/local_steps
    python scripts/local_steps_table.py --out r --framework torch tensorflow --periods 1 2 4 8 \\
        --delays 0 2 4 --compression none topk:ratio=0.01

A preset of hvd-compress-compare: for each framework it runs

    hvd-compress-compare --example digits --framework FW --np N --bandwidth uncapped \\
        --compression SPEC ... --local-sgd H ... --delay D ... --example-args '--epochs E' \\
        --out DIR/FW

(real ``horovodrun -np N`` launches of ``train_digits.py``; that folder keeps
compare's results.csv, results.md, plots and logs) and tabulates its rows with
the bytes each worker sends per epoch.  Synchronous training (D = 0) is the
baseline and always runs; at ``--np 1`` only it runs (one worker's local SGD and
DGA are plain SGD).  Writes ``local_steps.csv`` and ``local_steps.md`` and prints
the table.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_compress.tools import compare, runtools  # noqa: E402

COLUMNS = ["framework", "compression", "mode", "np", "epochs", "test_accuracy", "bytes_per_epoch",
           "bytes_vs_sync", "images_per_sec", "wall_s", "status"]


def compare_argv(args, framework: str, out: Path) -> list[str]:
    """hvd-compress-compare's arguments for one framework's rows."""
    argv = ["--out", str(out / framework), "--example", "digits", "--framework", framework,
            "--np", str(args.np), "--bandwidth", compare.UNCAPPED, "--compression", *args.compression,
            "--example-args", f"--epochs {args.epochs}", "--timeout", str(args.timeout)]
    if args.periods:
        argv += ["--local-sgd", *map(str, args.periods)]
    if any(args.delays):
        argv += ["--delay", *(str(d) for d in args.delays if d)]
    return argv + (["--quiet"] if args.quiet else [])


def table_row(args, row: dict) -> dict:
    """One of compare's rows as a row of the table: bytes per epoch instead of per step."""
    ok = row["status"] == "ok"
    steps = float(row.get("steps") or 0)
    per_epoch = float(row.get("bytes_per_step") or 0) * steps / args.epochs if ok else None
    return {"framework": row["framework"], "compression": row["compression"], "mode": compare.mode_of(row),
            "np": args.np, "epochs": args.epochs, "test_accuracy": row.get("test_accuracy") or None,
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


def parser():
    ap = runtools.script_parser(__doc__)
    ap.add_argument("--framework", nargs="+", choices=["torch", "tensorflow"], default=["torch"])
    ap.add_argument("--compression", nargs="+", type=runtools.spec_arg, default=["none"],
                    metavar="SPEC", help="compressor specs (default none)")
    ap.add_argument("--periods", nargs="*", type=runtools.positive_int, default=[1, 2, 4, 8],
                    metavar="H", help="local SGD averaging periods (default 1 2 4 8)")
    ap.add_argument("--delays", nargs="*", type=runtools.nonnegative_int, default=[0, 2, 4],
                    metavar="D", help="DGA delays, 0 = synchronous (default 0 2 4; sync always runs)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if not args.periods and not args.delays:
        ap.error("give at least one --periods or --delays value")
    try:  # the optimizers' own rules (DGA needs a one-round compressor), before any launch
        compare.check_modes(args.compression, compare.run_modes(args.periods, args.delays))
    except ValueError as exc:
        ap.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for framework in args.framework:
        compare.main(compare_argv(args, framework, out))
        rows += [table_row(args, r) for r in compare.read_csv(out / framework / "results.csv")]
    for r in rows:  # bytes relative to synchronous training of the same framework and spec
        base = next((b for b in rows if b["mode"] == compare.SYNC and b["framework"] == r["framework"]
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
    return 0 if rows and all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
