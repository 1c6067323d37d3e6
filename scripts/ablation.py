#!/usr/bin/env python
"""The DGC ablation on the digits example: test accuracy, mean and spread over seeds.

    python scripts/ablation.py --out results/ablation
    python scripts/ablation.py --out r --framework torch --ratios 0.001 --seeds 0 1 2

For each density it runs, as the DGC paper's ablation does (Lin et al. 2018,
Table 2): gradient dropping (top-k without error feedback: what is not sent is
lost), top-k with error feedback (local gradient accumulation), DGC without its
warm-up, and full DGC; plus ``none`` once per framework as the reference.  Each
cell is a real ``horovodrun -np N --gloo`` launch of ``train_digits.py`` (as
hvd-compress-compare launches its runs), one per seed.  Writes
``ablation.csv`` (one row per launch) and ``ablation.md`` (mean and spread,
in percentage points, per cell) and prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_compress.tools import compare, runtools  # noqa: E402

COLUMNS = ["framework", "method", "ratio", "compression", "seed", "test_accuracy",
           "bytes_per_step", "wall_s", "status"]


def methods(ratio: float) -> list[tuple[str, str]]:
    """(label, spec) of each ablation row at density ``ratio``."""
    r = f"{ratio:g}"
    return [("gradient dropping", f"topk:ratio={r},ef=false"),
            ("top-k + error feedback", f"topk:ratio={r}"),
            ("DGC, no warm-up", f"dgc:ratio={r},warmup_epochs=0"),
            ("DGC", f"dgc:ratio={r}")]


METHODS = ["none", "gradient dropping", "top-k + error feedback", "DGC, no warm-up", "DGC"]


def plan(args) -> list[dict]:
    runs = []
    for fw in args.framework:
        cells = [("none", "", "none")] + [(label, f"{ratio:g}", spec) for ratio in args.ratios
                                         for label, spec in methods(ratio)]
        cells = [c for c in cells if c[0] in args.methods]
        for label, ratio, spec in cells:
            for seed in args.seeds:
                runs.append({"framework": fw, "method": label, "ratio": ratio,
                             "compression": spec, "seed": seed})
    return runs


def run_one(args, run: dict, out: Path) -> dict:
    launch = SimpleNamespace(example_args=f"--epochs {args.epochs} --seed {run['seed']}",
                             timeout=args.timeout)
    crun = {"framework": run["framework"], "example": "digits", "compression": run["compression"],
            "np": args.np, "bandwidth": compare.UNCAPPED, "latency": ""}
    row = compare.execute(launch, crun, out / f"seed{run['seed']}")
    return {**run, "test_accuracy": row.get("test_accuracy"),
            "bytes_per_step": row.get("bytes_per_step"), "wall_s": row.get("wall_s"),
            "status": row["status"]}


def cells(rows: list[dict]) -> list[dict]:
    """Mean and spread (sample standard deviation, points) of each (framework, method, ratio)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["framework"], r["method"], r["ratio"])
        cell = out.setdefault(key, {"framework": key[0], "method": key[1], "ratio": key[2],
                                    "compression": r["compression"], "acc": [], "failed": 0})
        if r["status"] == "ok":
            cell["acc"].append(100.0 * float(r["test_accuracy"]))
        else:
            cell["failed"] += 1
    for cell in out.values():
        acc = cell["acc"]
        cell["mean"] = statistics.fmean(acc) if acc else None
        cell["spread"] = statistics.stdev(acc) if len(acc) > 1 else 0.0
    return list(out.values())


def markdown(table: list[dict], epochs: int, np_: int) -> str:
    lines = [f"digits, np {np_}, {epochs} epochs; test accuracy in %, mean ± standard deviation "
             "over seeds (each seed's value in brackets)", "",
             "| framework | density | method | compression | accuracy | seeds |",
             "|---|---|---|---|---:|---|"]
    for c in table:
        if c["mean"] is None:
            acc = "failed"
        else:
            acc = f"{c['mean']:.2f} ± {c['spread']:.2f}"
        seeds = ", ".join(f"{a:.1f}" for a in c["acc"])
        if c["failed"]:
            seeds += f" ({c['failed']} failed)"
        lines.append(f"| {c['framework']} | {c['ratio'] or '1'} | {c['method']} | "
                     f"`{c['compression']}` | {acc} | {seeds} |")
    return "\n".join(lines) + "\n"


def verdict(table: list[dict], frameworks, ratios) -> list[str]:
    """The ordering the DGC paper reports, checked per framework and density."""
    mean = {(c["framework"], c["method"], c["ratio"]): c["mean"] for c in table}
    lines = []
    for fw in frameworks:
        base = mean.get((fw, "none", ""))
        for ratio in ratios:
            r = f"{ratio:g}"
            drop, ef, dgc = (mean.get((fw, m, r)) for m in
                             ("gradient dropping", "top-k + error feedback", "DGC"))
            if None in (base, drop, ef, dgc):
                lines.append(f"{fw} {r}: incomplete (a run failed)")
                continue
            order = drop < ef <= dgc
            close = base - dgc <= 1.0
            lines.append(f"{fw} {r}: dropping {drop:.2f} < top-k+EF {ef:.2f} <= DGC {dgc:.2f}: "
                         f"{'yes' if order else 'NO'}; DGC within 1 point of none ({base:.2f}): "
                         f"{'yes' if close else 'NO'}")
    return lines


def parser() -> argparse.ArgumentParser:
    ap = runtools.script_parser(__doc__)
    ap.add_argument("--framework", nargs="+", choices=["torch", "tensorflow"],
                    default=["torch", "tensorflow"], help="default: both")
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.001, 0.01], metavar="R",
                    help="densities k/n (default 0.001 0.01)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="default 0 1 2")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, metavar="METHOD",
                    help="rows to run (default: all of " + ", ".join(repr(m) for m in METHODS)
                    + ")")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    for ratio in args.ratios:
        if not 0 < ratio <= 1:
            ap.error(f"--ratios: a density must be in (0, 1], got {ratio}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = runtools.launch_seeds(plan(args), "ablation", lambda run: run_one(args, run, out),
                                 args.quiet, out, COLUMNS)
    table = cells(rows)
    text = markdown(table, args.epochs, args.np) + "\n" + \
        "\n".join(verdict(table, args.framework, args.ratios)) + "\n"
    (out / "ablation.md").write_text(text)
    print(text, end="")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
