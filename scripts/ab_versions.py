#!/usr/bin/env python
"""Old code against new in one run: is anything slower?

    python scripts/ab_versions.py --old 14b9974                 # kernels and the main job's subset
    python scripts/ab_versions.py --old v0.2.8 --skip-compare --frameworks numpy torch
    python scripts/ab_versions.py --old HEAD~5 --rounds 3 --json ab.json

``--old`` is a git revision of this repository: it is checked out into a temporary
worktree (removed at the end) and run with this environment's Python, its package
first on ``PYTHONPATH``; the new side is this checkout.  Two measurements, each run
``--rounds`` times with the sides alternating (old first in odd rounds, new first in
even ones), so drift on a shared machine falls on both alike:

* kernels -- ``scripts/bench_kernels.py --json`` per framework (encode and decode of
  every compressor on one tensor of ``--numel`` elements): per compressor the ratio
  new/old of the encode and decode times (median over rounds);
* the main job's subset -- ``scripts/compare.py`` with ``--compression`` (``none``,
  top-k, DGC, 1-bit), ``--np`` 2, ``--bandwidth`` 1gbit (the defaults): per spec the
  ratio new/old of images per second.

A ratio of time above 1 means new is slower; of images per second below 1, slower.
The summary line gives the median ratio of each table.  ``1gbit`` needs root (the
links are capped with ``tc``); ``--bandwidth uncapped`` runs anywhere.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUBSET = ["none", "topk:ratio=0.01", "dgc:ratio=0.001", "onebit"]


def _run(cmd, tree: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def kernels(tree: Path, framework: str, numel: int, repeats: int) -> dict:
    """``{spec: (encode_ms, decode_ms)}`` from one bench_kernels run in ``tree``."""
    got = _run([sys.executable, "scripts/bench_kernels.py", "--framework", framework,
                "--numel", str(numel), "--repeats", str(repeats), "--json"], tree, 1800)
    if got.returncode != 0:
        raise RuntimeError(f"bench_kernels ({framework}, {tree}) failed:\n{got.stderr[-2000:]}")
    data = json.loads(got.stdout[got.stdout.index("{"):])
    return {r["compression"]: (r["encode_ms"], r["decode_ms"]) for r in data["results"]}


def compare(tree: Path, specs, np_: int, bandwidth: str) -> dict:
    """``{spec: images_per_sec}`` from one compare run in ``tree``."""
    with tempfile.TemporaryDirectory(prefix="ab-compare-") as out:
        got = _run([sys.executable, "scripts/compare.py", "--compression", *specs, "--np",
                    str(np_), "--bandwidth", bandwidth, "--out", out, "--quiet"], tree, 3600)
        if got.returncode != 0:
            raise RuntimeError(f"compare ({tree}) failed:\n{got.stdout[-1500:]}{got.stderr[-1500:]}")
        with open(Path(out) / "results.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    return {r["compression"]: float(r["images_per_sec"]) for r in rows
            if r.get("status") == "ok" and r.get("images_per_sec")}


def _ratios(old: list, new: list, pick) -> dict:
    """Per key, the median over rounds of ``pick(new) / pick(old)``."""
    keys = [k for k in old[0] if all(k in o for o in old) and all(k in n for n in new)]
    out = {}
    for k in keys:
        rs = [pick(n[k]) / pick(o[k]) for o, n in zip(old, new) if pick(o[k]) > 0]
        if rs:
            out[k] = statistics.median(rs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--old", required=True, help="git revision of the old code")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    ap.add_argument("--frameworks", nargs="+", default=["numpy", "torch", "tensorflow"],
                    help="bench_kernels frameworks (default numpy torch tensorflow)")
    ap.add_argument("--numel", type=int, default=2_000_000, help="kernel tensor size (2,000,000)")
    ap.add_argument("--repeats", type=int, default=3, help="bench_kernels repeats (3)")
    ap.add_argument("--compression", nargs="+", default=SUBSET, metavar="SPEC",
                    help=f"compare's specs (default {' '.join(SUBSET)})")
    ap.add_argument("--np", type=int, default=2, help="compare's workers (2)")
    ap.add_argument("--bandwidth", default="1gbit", help="compare's link rate (1gbit)")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.numel < 1 or args.np < 1:
        ap.error("--rounds, --numel and --np must be positive")
    rev = subprocess.run(["git", "rev-parse", "--verify", args.old + "^{commit}"], cwd=REPO,
                         capture_output=True, text=True)
    if rev.returncode != 0:
        ap.error(f"--old {args.old!r} is not a revision of {REPO}")
    tmp = Path(tempfile.mkdtemp(prefix="ab-old-"))
    old_tree = tmp / "old"
    subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), rev.stdout.strip()],
                   cwd=REPO, check=True, capture_output=True)
    sides = {"old": old_tree, "new": REPO}
    found = {"old": rev.stdout.strip()[:12], "kernels": {}, "compare": {}}
    try:
        for r in range(args.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for side in order:
                if not args.skip_kernels:
                    for fw in args.frameworks:
                        got = kernels(sides[side], fw, args.numel, args.repeats)
                        found["kernels"].setdefault(fw, {"old": [], "new": []})[side].append(got)
                        print(f"round {r + 1} {side:3} kernels {fw}: {len(got)} compressors",
                              flush=True)
                if not args.skip_compare:
                    got = compare(sides[side], args.compression, args.np, args.bandwidth)
                    found["compare"].setdefault(side, []).append(got)
                    print(f"round {r + 1} {side:3} compare: " + ", ".join(
                        f"{k} {v:.1f}/s" for k, v in got.items()), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=REPO,
                       capture_output=True)
        subprocess.run(["rm", "-rf", str(tmp)])
    summary = {}
    for fw, runs in found["kernels"].items():
        enc = _ratios(runs["old"], runs["new"], lambda t: t[0])
        dec = _ratios(runs["old"], runs["new"], lambda t: t[1])
        print(f"\nkernels, {fw}: new/old time (median of {args.rounds} rounds; > 1: slower)")
        print(f"  {'compression':28} {'encode':>8} {'decode':>8}")
        for k in enc:
            print(f"  {k:28} {enc[k]:8.2f} {dec.get(k, float('nan')):8.2f}")
        summary[f"kernels {fw}"] = statistics.median(list(enc.values()) + list(dec.values()))
    if found["compare"]:
        ips = _ratios(found["compare"]["old"], found["compare"]["new"], lambda v: v)
        print(f"\ncompare, np {args.np}, {args.bandwidth}: new/old images/s (< 1: slower)")
        for k, v in ips.items():
            print(f"  {k:28} {v:8.2f}")
        summary["compare"] = statistics.median(ips.values())
    print("\nmedian ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({**found, "median_ratios": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
