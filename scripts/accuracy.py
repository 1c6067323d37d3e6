#!/usr/bin/env python
"""Every compressor at its defaults on the digits example: test accuracy (mean and spread
over seeds) and images/s, beside ``none``, in both frameworks.

    python scripts/accuracy.py --out results/accuracy
    python scripts/accuracy.py --out r --framework torch --seeds 0 --specs none topk
    python scripts/accuracy.py --out r --example-args "--min-numel 0"   # the rule off

Each cell is a real ``horovodrun -np N --gloo`` launch of ``train_digits.py``
(uncapped local link), one per seed, with the per-tensor policy's defaults
(small tensors uncompressed) unless ``--example-args`` says otherwise.
Writes ``accuracy.csv`` (one row per launch) and ``accuracy.md`` (per
framework and compressor: accuracy mean ± standard deviation in %, its
distance to ``none``'s, mean bytes per step, images/s and its ratio to
``none``'s) and prints the table; the targets of issue 16 (within 1 point of
``none``, top-k at 1% and 1-bit within 0.5; top-k at >= 0.7x ``none``'s
images/s) are checked in the last lines.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_compress.core import registry  # noqa: E402
from hvd_compress.tools import compare, runtools  # noqa: E402

COLUMNS = ["framework", "compression", "seed", "test_accuracy", "images_per_sec",
           "bytes_per_step", "wall_s", "status"]
#: tighter targets (issue 16): these within 0.5 points of none
TIGHT = ("topk", "onebit")


def default_specs() -> list[str]:
    """Each registered algorithm at its defaults (``none`` first)."""
    return [a.name for a in registry.algorithms()]


def run_one(args, fw: str, spec: str, seed: int, out: Path) -> dict:
    launch = SimpleNamespace(example_args=f"--epochs {args.epochs} --seed {seed} "
                                          f"{args.example_args}", timeout=args.timeout)
    crun = {"framework": fw, "example": "digits", "compression": spec, "np": args.np,
            "bandwidth": compare.UNCAPPED, "latency": ""}
    row = compare.execute(launch, crun, out / f"seed{seed}")
    return {"framework": fw, "compression": spec, "seed": seed,
            **{k: row.get(k) for k in COLUMNS[3:]}}


def _stats(values):
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0) \
        if values else (None, None)


def table(rows: list[dict]) -> list[dict]:
    """Per (framework, compression): accuracy (%) and images/s mean and spread."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        c = cells.setdefault((r["framework"], r["compression"]),
                             {"framework": r["framework"], "compression": r["compression"],
                              "acc": [], "ips": [], "bytes": [], "failed": 0})
        if r["status"] == "ok":
            c["acc"].append(100.0 * float(r["test_accuracy"]))
            c["ips"].append(float(r["images_per_sec"]))
            c["bytes"].append(float(r["bytes_per_step"]))
        else:
            c["failed"] += 1
    for c in cells.values():
        c["mean"], c["spread"] = _stats(c["acc"])
        c["ips_mean"], _ = _stats(c["ips"])
        c["bytes_mean"], _ = _stats(c["bytes"])
    return list(cells.values())


def markdown(cells: list[dict], args) -> str:
    base = {c["framework"]: c for c in cells if c["compression"] == "none"}
    lines = [f"digits, np {args.np}, {args.epochs} epochs, uncapped local link; "
             f"extra flags: `{args.example_args.strip() or '(none)'}`; accuracy in %, mean ± "
             "standard deviation over seeds (each seed's value in brackets)", "",
             "| framework | compression | accuracy | vs none (points) | bytes/step | images/s "
             "| vs none |", "|---|---|---:|---:|---:|---:|---:|"]
    for c in cells:
        b = base.get(c["framework"])
        if c["mean"] is None:
            lines.append(f"| {c['framework']} | `{c['compression']}` | failed | | | | |")
            continue
        gap = f"{c['mean'] - b['mean']:+.2f}" if b and b["mean"] is not None else ""
        ratio = f"{c['ips_mean'] / b['ips_mean']:.2f}x" if b and b["ips_mean"] else ""
        seeds = ", ".join(f"{a:.1f}" for a in c["acc"])
        lines.append(f"| {c['framework']} | `{c['compression']}` | {c['mean']:.2f} ± "
                     f"{c['spread']:.2f} ({seeds}) | {gap} | {c['bytes_mean']:,.0f} | "
                     f"{c['ips_mean']:,.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def verdict(cells: list[dict]) -> list[str]:
    base = {c["framework"]: c for c in cells if c["compression"] == "none"}
    lines = []
    for c in cells:
        b = base.get(c["framework"])
        if c["compression"] == "none" or b is None or None in (c["mean"], b["mean"]):
            continue
        limit = 0.5 if c["compression"].split(":")[0].split("+")[0] in TIGHT else 1.0
        ok = b["mean"] - c["mean"] <= limit
        line = (f"{c['framework']} {c['compression']}: {c['mean']:.2f} vs none {b['mean']:.2f}"
                f" -> within {limit:g} point{'s' if limit != 1 else ''}: {'yes' if ok else 'NO'}")
        if c["compression"].startswith("topk") and b["ips_mean"]:
            r = c["ips_mean"] / b["ips_mean"]
            line += f"; images/s {r:.2f}x none (target >= 0.7): {'yes' if r >= 0.7 else 'NO'}"
        lines.append(line)
    return lines


def parser():
    ap = runtools.script_parser(__doc__)
    ap.add_argument("--framework", nargs="+", choices=["torch", "tensorflow"],
                    default=["torch", "tensorflow"], help="default: both")
    ap.add_argument("--specs", nargs="+", type=runtools.spec_arg, default=None, metavar="SPEC",
                    help="compressions to run (default: every registered compressor at its "
                         "defaults; none is always added)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="default 0 1 2")
    ap.add_argument("--example-args", default="", metavar="ARGS",
                    help="more flags for train_digits.py, e.g. '--min-numel 0'")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    specs = args.specs or default_specs()
    specs = ["none"] + [s for s in specs if s != "none"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [{"framework": fw, "compression": s, "seed": seed}
            for fw in args.framework for s in specs for seed in args.seeds]
    rows = runtools.launch_seeds(
        runs, "accuracy", lambda r: run_one(args, r["framework"], r["compression"], r["seed"], out),
        args.quiet, out, COLUMNS)
    cells = table(rows)
    text = markdown(cells, args) + "\n" + "\n".join(verdict(cells)) + "\n"
    (out / "accuracy.md").write_text(text)
    print(text, end="")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
