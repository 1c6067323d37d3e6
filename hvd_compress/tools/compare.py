"""Compare compressors over worker counts and link bandwidths with real Horovod runs.

    hvd-compress-compare --out results                       # the small default matrix
    hvd-compress-compare --example digits --np 1 2 --compression none topk:ratio=0.01 \\
        --bandwidth uncapped 1gbit --out results-digits --predict

For each compressor spec x mode x worker count (``--np``) x bandwidth
(``--bandwidth``; ``uncapped`` or a rate such as ``100mbit``/``1gbit``) this
launches one of the
examples (``--example synthetic|digits|cifar10``, ``--framework
torch|tensorflow``) under Horovod -- ``horovodrun --gloo`` when uncapped; with a
rate, one network namespace per worker behind ``tc``-capped links
(:mod:`hvd_compress.tools.netcap`, needs root) -- and collects the example's
``--json`` summary.  The modes: ``sync`` (ordinary synchronous training) always,
then local SGD for each period of ``--local-sgd H ...`` and Delayed Gradient
Averaging for each delay of ``--delay D ...`` (at more than one worker: for a
single worker both are plain SGD; ``--modes-for SPEC ...`` runs them for those
compressors only), and TensorFlow's MultiWorkerMirroredStrategy with ``--strategy
mwms`` (the TensorFlow example, a baseline row per setting).  With
``--target-accuracy A --stop-at-target`` every run stops at the first epoch that
reaches A (a time-to-accuracy matrix need not train on).  Into ``--out`` go:

* ``results.csv``: one row per run, the keys of the examples' ``--json``
  summary (:data:`hvd_compress.tools.runtools.SUMMARY_KEYS`) plus
  ``bandwidth``, ``latency``, ``status`` (``ok`` or why it failed),
  ``step_ms``, ``log`` (that run's output), ``mode``, the accuracy curve
  (``curve``: JSON, the examples' test accuracy and training seconds after
  every epoch), ``best_accuracy`` and, with ``--target-accuracy A``,
  ``target_accuracy``, ``time_to_target_s`` and ``epochs_to_target`` (blank
  when the run never reached A);
* ``results.md``: the same as a Markdown table, with the speed-up over
  ``none`` (in sync mode) at the same worker count and bandwidth, the best
  method per setting and, with a target, the fastest method to it per setting;
* ``throughput.png``, ``bytes_per_step.png``, ``time_split.png`` and, when the
  example reports accuracy, ``accuracy_vs_time.png`` (one point per run) and
  ``accuracy_curves.png`` (accuracy against training time, one line per run,
  one panel per worker count and bandwidth);
* with ``--predict``, ``prediction.md``: the cost model
  (:mod:`hvd_compress.tools.costmodel`) fitted to these runs, its step-time
  predictions at other bandwidths and up to 1024 workers, the crossover
  bandwidths, and its error on each capped run it was not fitted on (sync-mode
  runs only: the model is one exchange per step).

A run that fails is recorded as failed (with its log) and the rest go on;
``--resume`` keeps the rows of runs that succeeded and runs only the rest.
A single worker sends nothing, so ``--np 1`` runs once, uncapped.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from . import costmodel, hvdrun, netcap, runtools

EXAMPLES = {"synthetic": "synthetic_benchmark.py", "digits": "train_digits.py",
            "digits-wide": "train_digits.py", "cifar10": "train_cifar10.py"}
FRAMEWORK_DIRS = {"torch": "torch_examples", "tensorflow": "tf_examples"}
TOOLS_DIR = Path(__file__).resolve().parent
DEFAULT_COMPRESSIONS = ["none", "fp16", "topk:ratio=0.01", "dgc:ratio=0.001", "onebit", "qsgd:levels=7",
                        "terngrad", "randomk:ratio=0.01", "powersgd:rank=2"]
# Small enough for a 2-core machine, big enough (21.8M parameters, 87 MB of
# gradients a step) that the link matters: a small ResNet trunk under a
# large-vocabulary classifier (80,000 classes), the shape of models whose
# softmax/embedding layers dominate and whose gradients are large per FLOP.
DEFAULT_EXAMPLE_ARGS = {
    "synthetic": "--width 64 --blocks 1 1 1 --num-classes 80000 --image-size 8 --batch-size 8 "
                 "--num-warmup-batches 2 --num-iters 3 --num-batches-per-iter 3",
    "digits": "--epochs 5",
    # real data where the link matters: the digits under a 10.8M-parameter MLP (43 MB of
    # gradients a step)
    "digits-wide": "--model wide --batch-size 64 --epochs 6",
    "cifar10": "--epochs 1",
}
RUN_KEYS = ("framework", "example", "compression", "np", "bandwidth", "latency", "mode", "nodes")
#: results.csv's columns: the examples' summary keys, then what compare adds (new ones are
#: appended, so that the older columns keep their places)
COLUMNS = (list(runtools.SUMMARY_KEYS) + ["bandwidth", "latency", "status", "step_ms",
                                          "collectives_per_step", "parameters", "log",
                                          "mode", "target_accuracy", "time_to_target_s",
                                          "epochs_to_target", "best_accuracy", runtools.CURVE,
                                          "nodes", "local_bytes_per_step", "hierarchical"])
UNCAPPED = "uncapped"
SYNC = "sync"
#: the baseline without Horovod: TensorFlow's MultiWorkerMirroredStrategy (``--strategy
#: mwms``; uncompressed, launched by :mod:`.mwms`, in the namespaces when capped)
MWMS = "TF MWMS"
#: with ``--nodes``: compressed tensors by every worker's allgather (or integer sum), not
#: the hierarchical exchange (``--hierarchical off``)
FLAT = "flat"
MWMS_EXAMPLES = ("digits", "digits-wide")


# -- modes: how often the workers talk --------------------------------------------------------
def local_sgd_mode(period: int) -> str:
    return f"local SGD H={int(period)}"


def dga_mode(delay: int) -> str:
    return SYNC if int(delay) == 0 else f"DGA D={int(delay)}"


def run_modes(periods=(), delays=(), strategy: str = "horovod") -> list[str]:
    """The modes of a matrix: sync first (the baseline), then DGA delays, then local SGD
    periods (``--delay 0`` is sync itself), then TensorFlow's strategy with
    ``strategy="mwms"``."""
    modes = [SYNC] + [dga_mode(d) for d in delays or ()] + [local_sgd_mode(h) for h in periods or ()]
    modes += [MWMS] if strategy == "mwms" else []
    return list(dict.fromkeys(modes))


def mode_of(row: dict) -> str:
    """A row's mode (rows of results written before modes existed are sync)."""
    return row.get("mode") or SYNC


def mode_flags(mode: str) -> list[str]:
    """The example flags a mode needs."""
    if mode in ("", SYNC):
        return []
    if mode == MWMS:
        return ["--strategy", "mwms"]
    if mode == FLAT:
        return ["--hierarchical", "off"]
    m = re.fullmatch(r"local SGD H=(\d+)", mode)
    if m:
        return ["--local-sgd", "--backward-passes-per-step", m.group(1)]
    m = re.fullmatch(r"DGA D=(\d+)", mode)
    if m:
        return ["--delay", m.group(1)]
    raise ValueError(f"unknown mode {mode!r} (sync, 'local SGD H=<period>', 'DGA D=<delay>' "
                     f"or {MWMS!r})")


def check_modes(specs, modes) -> None:
    """Raise ValueError for a compressor that a mode cannot run (the optimizers' own rule,
    e.g. DGA needs a one-round compressor), before anything is launched."""
    from ..localsteps import check_local_args
    for spec in specs:
        for mode in modes:
            if mode in (MWMS, FLAT):  # MWMS: uncompressed whatever the specs; flat: any
                continue
            flags = mode_flags(mode)
            local = "--local-sgd" in flags
            period = int(flags[-1]) if local else 1
            delay = int(flags[-1]) if "--delay" in flags else 0
            for s in _specs(spec):
                try:
                    check_local_args(local, period, 0, delay, True, s)
                except ValueError as exc:
                    raise ValueError(f"{spec} in mode {mode}: {exc}") from None


def method(row: dict) -> str:
    """What a row compares: its compression, and its mode when not sync."""
    mode = mode_of(row)
    return row["compression"] if mode == SYNC else f"{row['compression']} ({mode})"


# -- the matrix --------------------------------------------------------------------------
def bandwidth_label(text: str) -> str:
    if text.lower() in (UNCAPPED, "none", "0"):
        return UNCAPPED
    return netcap.format_rate(netcap.parse_rate(text))


def nodes_of(row: dict) -> int:
    """A row's simulated nodes (rows of results written before ``--nodes``: 1)."""
    return int(row.get("nodes") or 1)


def takes_hierarchy(spec: str) -> bool:
    """Whether some tensor of ``spec`` takes the hierarchical exchange (payloads gathered,
    or integer codes summed: :func:`hvd_compress.core.hierarchy.sharded`)."""
    from ..core import build
    from ..core.hierarchy import sharded
    return any(sharded(build(s)) for s in _specs(spec))


def plan_runs(args, capped_ok: bool) -> list[dict]:
    runs = []
    modes = run_modes(getattr(args, "local_sgd", None), getattr(args, "delay", None),
                      getattr(args, "strategy", "horovod"))
    nodes = int(getattr(args, "nodes", 1) or 1)
    if nodes > 1:  # the hierarchical exchange (sync) and the flat one side by side
        modes.insert(1, FLAT)

    def add(spec, mode):
        if mode == FLAT and not takes_hierarchy(spec):
            return  # summable payloads go by one allreduce either way
        for np_ in args.np:
            if np_ == 1 and mode not in (SYNC, MWMS):
                continue  # one worker: local SGD and DGA are plain SGD
            bands = [UNCAPPED] if np_ == 1 else list(args.bandwidth)
            if not capped_ok:
                bands = [UNCAPPED]
            for bw in dict.fromkeys(bands):
                runs.append({"framework": "tensorflow" if mode == MWMS else args.framework,
                             "example": args.example,
                             "compression": spec, "np": np_, "bandwidth": bw,
                             "latency": args.latency if bw != UNCAPPED else "", "mode": mode,
                             "nodes": nodes if np_ > 1 else 1})

    only = getattr(args, "modes_for", None)
    for spec in args.compression:
        for mode in modes:
            if mode in (SYNC, FLAT) or (mode != MWMS and (not only or spec in only)):
                add(spec, mode)
    if MWMS in modes:  # the baseline's rows, once: uncompressed
        add("none", MWMS)
    return runs


def run_key(row: dict) -> tuple:
    return tuple(mode_of(row) if k == "mode" else str(nodes_of(row)) if k == "nodes"
                 else str(row.get(k, "")) for k in RUN_KEYS)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in text)


def run_name(run: dict) -> str:
    lat = f"_lat{run['latency']}" if run["latency"] else ""
    mode = "" if mode_of(run) == SYNC else "_" + _safe(mode_of(run))
    nodes = f"_{nodes_of(run)}nodes" if nodes_of(run) > 1 else ""
    return (f"{run['framework']}_{run['example']}_{_safe(run['compression'])}{mode}_np{run['np']}"
            f"{nodes}_{run['bandwidth']}{lat}")


def examples_dir(framework: str, tools_dir: Path | None = None) -> Path:
    """The folder holding ``framework``'s example scripts.

    First a checkout's own (``<repo>/torch_examples`` beside ``<repo>/hvd_compress``),
    so that edits to the examples are what runs; else the copy an installed package
    carries (``hvd_compress/tools/examples/torch_examples``, made by setup.py's
    build step).  ``tools_dir``: this sub-package's folder (default: where this
    module lies).  A folder counts only if it holds every example script."""
    tools_dir = Path(tools_dir) if tools_dir is not None else TOOLS_DIR
    name = FRAMEWORK_DIRS[framework]
    candidates = (tools_dir.parents[1] / name, tools_dir / "examples" / name)
    for folder in candidates:
        if all((folder / script).is_file() for script in EXAMPLES.values()):
            return folder
    raise FileNotFoundError(
        f"cannot find the {framework} example scripts ({', '.join(sorted(EXAMPLES.values()))}): "
        f"looked in {candidates[0]} (a checkout of the repository) and in {candidates[1]} "
        "(the copy an installed package carries); run from a checkout, or install hvd-compress "
        "from its repository or a wheel built from it")


def example_command(args, run: dict, json_path: Path) -> list[str]:
    script = examples_dir(run["framework"]) / EXAMPLES[run["example"]]
    extra = shlex.split(args.example_args if args.example_args is not None
                        else DEFAULT_EXAMPLE_ARGS[run["example"]])
    for flag in ("min_numel", "start_step"):  # the per-tensor policy's knobs, when given
        if getattr(args, flag, None) is not None:
            extra += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    extra += mode_flags(mode_of(run))
    if getattr(args, "stop_at_target", False):
        extra += ["--stop-at", f"{args.target_accuracy:g}"]
    return [sys.executable, str(script), *extra, "--compression", run["compression"],
            "--json", str(json_path), "--quiet"]


def horovodrun() -> list[str]:
    """How a run is launched uncapped: ``horovodrun``, less its start-up probe
    (:mod:`.hvdrun`)."""
    return hvdrun.command()


def execute(args, run: dict, out: Path) -> dict:
    """Launch one run; returns its CSV row (status ok or failed)."""
    name = run_name(run)
    json_path = out / "runs" / f"{name}.json"
    log_path = out / "logs" / f"{name}.log"
    for p in (json_path, log_path):
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            p.unlink()
    cmd = example_command(args, run, json_path)
    t0 = time.perf_counter()
    try:
        if run["bandwidth"] == UNCAPPED:
            if mode_of(run) == MWMS:
                full = [sys.executable, "-m", "hvd_compress.tools.mwms", "-np", str(run["np"]), *cmd]
            elif nodes_of(run) > 1:  # Horovod sees the nodes; loopback links
                full = [sys.executable, "-m", "hvd_compress.tools.nodesrun", "--nodes",
                        str(nodes_of(run)), "-np", str(run["np"]), *cmd]
            else:
                full = [*horovodrun(), "-np", str(run["np"]), "-H", f"localhost:{run['np']}",
                        "--gloo", *cmd]
            with open(log_path, "w") as log:
                log.write("$ " + shlex.join(full) + "\n")
                log.flush()
                proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                try:
                    rc = netcap.wait_all([proc], args.timeout)
                finally:
                    netcap.stop(proc)
        else:
            latency = netcap.parse_latency(run["latency"]) if run["latency"] else 0.0
            nodes = nodes_of(run)
            per = int(run["np"]) // nodes if nodes > 1 else 1  # workers per namespace
            where = f"{nodes} namespaces of {per} workers" if nodes > 1 else f"{run['np']} namespaces"
            with open(log_path, "w") as log:
                log.write(f"# {where}, links capped at {run['bandwidth']}"
                          f"{', latency ' + run['latency'] if latency else ''}\n$ "
                          + shlex.join(cmd) + "\n")
            with netcap.CappedNetwork(nodes if nodes > 1 else run["np"],
                                      netcap.parse_rate(run["bandwidth"]), latency) as net:
                if mode_of(run) == MWMS:
                    rc = netcap.launch_mwms(net, cmd, log_path=str(log_path), timeout_s=args.timeout)
                else:
                    rc = netcap.launch_horovod(net, cmd, log_path=str(log_path),
                                               timeout_s=args.timeout,
                                               per_node=per)
    except Exception as exc:  # a launcher error is this run's failure, not the matrix's
        with open(log_path, "a") as log:
            log.write(f"\ncompare: launch failed: {exc!r}\n")
        rc = -1
    wall = time.perf_counter() - t0
    row = dict(run)
    row["log"] = str(log_path)
    if rc == 0 and json_path.exists():
        doc = json.loads(json_path.read_text())
        for key in COLUMNS:
            if key in doc and key not in RUN_KEYS:
                row[key] = doc[key]
        if doc.get(runtools.CURVE) is not None:  # one CSV cell
            row[runtools.CURVE] = json.dumps(doc[runtools.CURVE], separators=(",", ":"))
        row["step_ms"] = round(sum(float(doc.get(k) or 0.0)
                                   for k in ("compute_ms", "encode_ms", "comm_ms", "decode_ms")), 3)
        row["status"] = "ok"
    else:
        row["status"] = ("timed out" if rc == 124 else f"failed (exit {rc})") + f"; see {log_path}"
        row["wall_s"] = round(wall, 3)
    return row


# -- results files ---------------------------------------------------------------------------
def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in COLUMNS})
    os.replace(tmp, path)


def _f(row: dict, key: str) -> float | None:
    try:
        value = float(row.get(key, ""))
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def ok_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def _setting(r: dict) -> tuple:
    """Runs compared with each other: same framework, example, np, nodes, bandwidth, latency."""
    return (r["framework"], r["example"], str(r["np"]), r["bandwidth"], r.get("latency", ""),
            nodes_of(r))


def setting_of(rows: list[dict]):
    """A function giving each of ``rows`` its setting (:func:`_setting`).  TensorFlow's
    strategy (mode TF MWMS, framework tensorflow) joins the setting of the Horovod rows
    beside it whatever their framework: with ``--framework torch --strategy mwms`` the
    baseline trains the same MLP in Keras, and is compared with the torch runs.  Where
    Horovod rows of both frameworks share a setting it stays with tensorflow's."""
    horovod: dict = {}
    for r in rows:
        if mode_of(r) != MWMS:
            horovod.setdefault(_setting(r)[1:], set()).add(r["framework"])

    def key(r: dict) -> tuple:
        s = _setting(r)
        frameworks = horovod.get(s[1:], set())
        if mode_of(r) == MWMS and len(frameworks) == 1:
            return (next(iter(frameworks)),) + s[1:]
        return s
    return key


def is_baseline(r: dict) -> bool:
    """``none`` in sync mode: what speed-ups and times to target are measured against."""
    return mode_of(r) == SYNC and all(s.name == "none" for s in _specs(r["compression"]))


def speedups(rows: list[dict]) -> dict:
    """run key -> images/s over that of none in sync mode at the same framework, example,
    np and bandwidth."""
    setting = setting_of(rows)
    base = {setting(r): _f(r, "images_per_sec") for r in ok_rows(rows) if is_baseline(r)}
    out = {}
    for r in ok_rows(rows):
        b = base.get(setting(r))
        ips = _f(r, "images_per_sec")
        if b and ips is not None:
            out[run_key(r)] = ips / b
    return out


def _where(setting: tuple) -> str:
    _, _, np_, bw, lat, nodes = setting
    return f"np {np_}" + (f" in {nodes} nodes" if nodes > 1 else "") + f", {bw}" + \
        (f", latency {lat}" if lat else "")


def _settings(rows: list[dict], multi_only: bool) -> list[tuple[tuple, list[dict]]]:
    groups: dict = {}
    setting = setting_of(rows)
    for r in ok_rows(rows):
        if int(r["np"]) > 1 or not multi_only:
            groups.setdefault(setting(r), []).append(r)
    return sorted(groups.items(), key=lambda kv: (kv[0][:2], int(kv[0][2]), kv[0][5], str(kv[0][3]),
                                                  kv[0][4]))


def best_lines(rows: list[dict]) -> list[str]:
    """Per worker count and bandwidth (np > 1): the method (compressor, mode) with the
    most images/s and its speed-up over none in sync mode."""
    sp = speedups(rows)
    lines = []
    for setting, rs in _settings(rows, multi_only=True):
        rs = [r for r in rs if run_key(r) in sp]
        if not rs:
            continue
        best = max(rs, key=lambda r: _f(r, "images_per_sec") or 0.0)
        lines.append(f"best at {_where(setting)}: {method(best)} -- {_f(best, 'images_per_sec'):.1f} "
                     f"images/s, {sp[run_key(best)]:.2f}x none")
    return lines


# -- time to accuracy --------------------------------------------------------------------------
def curve_of(row: dict) -> list[dict]:
    """A row's accuracy curve (points with epoch, seconds, test_accuracy), in epoch order;
    [] when it has none (a failed run, an example without accuracy)."""
    raw = row.get(runtools.CURVE)
    if not raw:
        return []
    points = json.loads(raw) if isinstance(raw, str) else raw
    return sorted((p for p in points if p.get("test_accuracy") is not None), key=lambda p: p["epoch"])


def reach(curve: list[dict], target: float) -> dict | None:
    """The first point of ``curve`` whose test accuracy is at or above ``target`` (None:
    the run never got there)."""
    return next((p for p in curve if p["test_accuracy"] >= target), None)


def check_target(target: float) -> float:
    return runtools.check_accuracy(target, "--target-accuracy")


def best_accuracy(row: dict) -> float | None:
    """The best test accuracy a successful run reached (its curve's, else its final one)."""
    if row.get("status") != "ok":
        return None
    accs = [p["test_accuracy"] for p in curve_of(row)]
    return max(accs) if accs else _f(row, "test_accuracy")


def hit(row: dict, target: float) -> dict | None:
    """The curve point at which a successful run first reached ``target`` (None: never)."""
    return reach(curve_of(row), target) if row.get("status") == "ok" else None


def missed(row: dict, target: float) -> bool:
    """Whether a successful run with an accuracy curve never reached ``target``."""
    return row.get("status") == "ok" and bool(curve_of(row)) and hit(row, target) is None


def add_targets(rows: list[dict], target: float | None) -> list[dict]:
    """Fill each row's ``best_accuracy`` and, with a target, ``target_accuracy``,
    ``time_to_target_s`` and ``epochs_to_target`` (blank where the run never reached
    it) from its curve; returns ``rows``.  Recomputed from the curves every time, so a
    resumed matrix may change its target."""
    for r in rows:
        best = best_accuracy(r)
        point = hit(r, target) if target is not None else None
        r["best_accuracy"] = "" if best is None else best
        r["target_accuracy"] = "" if target is None else target
        r["time_to_target_s"] = point["seconds"] if point else ""
        r["epochs_to_target"] = point["epoch"] if point else ""
    return rows


def target_lines(rows: list[dict], target: float) -> list[str]:
    """Per worker count and bandwidth: the method that reached ``target`` soonest, and
    how much sooner than none in sync mode; or that no run reached it."""
    lines = []
    for setting, rs in _settings(rows, multi_only=False):
        curved = [r for r in rs if curve_of(r)]
        if not curved:
            continue
        reached = [(hit(r, target), r) for r in curved if hit(r, target) is not None]
        if not reached:
            top = max(curved, key=lambda r: best_accuracy(r) or 0.0)
            lines.append(f"no run reached {target:g} at {_where(setting)}; the best accuracy was "
                         f"{method(top)}'s {best_accuracy(top):.4f}")
            continue
        point, best = min(reached, key=lambda pr: pr[0]["seconds"])
        line = (f"fastest to {target:g} at {_where(setting)}: {method(best)} -- {point['seconds']:.2f} s, "
                f"{point['epoch']} epoch(s)")
        base = next((r for r in curved if is_baseline(r)), None)
        if base is not None and base is not best:
            at = hit(base, target)
            if at is not None:
                ratio = at["seconds"] / point["seconds"] if point["seconds"] > 0 else math.inf
                line += f", {ratio:.2f}x sooner than none ({at['seconds']:.2f} s)"
            else:
                line += f"; none missed it (best {best_accuracy(base):.4f})"
        lines.append(line)
    return lines


def write_markdown(path: Path, rows: list[dict], target: float | None = None,
                   stopped: bool = False) -> None:
    """results.md: the table (a mode column when some run is not sync; with a target,
    the time and epochs to it, or "missed" and the best accuracy reached), then the best
    method per setting and, with a target, the fastest to it; ``stopped``: the runs
    ended at the target (``--stop-at-target``), which the heading then says."""
    sp = speedups(rows)
    modes = any(mode_of(r) != SYNC for r in rows)
    head = (["framework", "example", "compression"] + (["mode"] if modes else [])
            + ["np", "bandwidth", "images/s", "per worker", "vs none", "bytes/step", "compute ms",
               "encode ms", "comm ms", "decode ms", "accuracy"]
            + (["to target s", "epochs to target"] if target is not None else []) + ["wall s", "status"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        okay = r.get("status") == "ok"

        def num(key, fmt="{:.1f}"):
            v = _f(r, key)
            return fmt.format(v) if (okay and v is not None) else ""
        s = sp.get(run_key(r))
        bw = r["bandwidth"] + (f" +{r['latency']}" if r.get("latency") else "")
        reached = []
        if target is not None:
            point = hit(r, target)
            if point is not None:
                reached = [f"{point['seconds']:.2f}", str(point["epoch"])]
            elif missed(r, target):
                reached = [f"missed (best {best_accuracy(r):.4f})", ""]
            else:
                reached = ["", ""]
        lines.append("| " + " | ".join(
            [r["framework"], r["example"], f"`{r['compression']}`"] + ([mode_of(r)] if modes else []) + [
                str(r["np"]) + (f" ({nodes_of(r)} nodes)" if nodes_of(r) > 1 else ""), bw,
                num("images_per_sec"), num("images_per_sec_per_worker"),
                f"{s:.2f}x" if s is not None else "", num("bytes_per_step", "{:,.0f}"),
                num("compute_ms"), num("encode_ms"), num("comm_ms"), num("decode_ms"),
                num("test_accuracy", "{:.4f}")] + reached + [
                num("wall_s"), "ok" if okay else r.get("status", "").split(";")[0]]) + " |")
    text = "\n".join(lines) + "\n"
    if target is not None:
        text = (f"Target test accuracy {target:g}: time to target is the training time (evaluation not "
                "counted) until the end of the first epoch whose test accuracy reached it."
                + (" Every run stopped there (--stop-at-target): its accuracy is that epoch's."
                   if stopped else "") + "\n\n" + text)
    bl = best_lines(rows) + (target_lines(rows, target) if target is not None else [])
    if bl:
        text += "\n" + "\n".join(f"- {line}" for line in bl) + "\n"
    path.write_text(text)


def plot(out: Path, rows: list[dict], target: float | None = None) -> list[str]:
    """The PNG plots; returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ok_rows(rows)
    if not rows:
        return []
    written = []
    methods = list(dict.fromkeys(method(r) for r in rows))
    bands = list(dict.fromkeys(r["bandwidth"] for r in rows))

    # throughput against worker count, one panel per bandwidth (np 1 is in every panel)
    fig, axes = plt.subplots(1, len(bands), figsize=(5.5 * len(bands), 4.2), squeeze=False)
    for ax, bw in zip(axes[0], bands):
        for name in methods:
            pts = sorted((int(r["np"]), _f(r, "images_per_sec")) for r in rows
                         if method(r) == name and (r["bandwidth"] == bw or int(r["np"]) == 1))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_title(f"links: {bw}")
        ax.set_xlabel("workers (np)")
        ax.set_ylabel("images/s (all workers)")
        ax.set_xticks(sorted({int(r["np"]) for r in rows}))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    written.append(_save(fig, out / "throughput.png"))

    # bytes one worker sends per step
    per_spec = {}
    for r in rows:
        if int(r["np"]) > 1 or method(r) not in per_spec:
            per_spec[method(r)] = _f(r, "bytes_per_step") or 0.0
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(per_spec) + 1.5))
    names = list(per_spec)
    ax.barh(names, [max(per_spec[n], 1.0) for n in names], color="tab:blue")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("bytes sent per step per worker (log)")
    for i, n in enumerate(names):
        ax.text(max(per_spec[n], 1.0), i, f" {per_spec[n] / 1e6:.2f} MB", va="center", fontsize=7)
    fig.tight_layout()
    written.append(_save(fig, out / "bytes_per_step.png"))

    # where the step time goes, stacked, one bar per run
    labels, parts = [], {k: [] for k in ("compute_ms", "encode_ms", "comm_ms", "decode_ms")}
    for r in rows:
        labels.append(f"{method(r)}\nnp{r['np']} {r['bandwidth']}")
        for k in parts:
            parts[k].append(_f(r, k) or 0.0)
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(labels)), 5))
    bottom = [0.0] * len(labels)
    for k, color in zip(parts, ("tab:gray", "tab:orange", "tab:red", "tab:green")):
        ax.bar(range(len(labels)), parts[k], bottom=bottom, label=k.replace("_ms", ""), color=color)
        bottom = [b + v for b, v in zip(bottom, parts[k])]
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel("ms per step")
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out / "time_split.png"))

    acc = [r for r in rows if _f(r, "test_accuracy") is not None]
    if acc:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in methods:
            pts = [(_f(r, "wall_s"), _f(r, "test_accuracy"), r) for r in acc if method(r) == name]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=name)
                for x, y, r in pts:
                    ax.annotate(f"np{r['np']} {r['bandwidth']}", (x, y), fontsize=6)
        ax.set_xlabel("wall-clock time of the run (s)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "accuracy_vs_time.png"))

    panels = curve_panels(rows)
    if panels:
        written.append(_plot_curves(plt, out / "accuracy_curves.png", panels, methods, target))
    return written


def curve_panels(rows: list[dict]) -> dict:
    """(np, bandwidth) -> the successful rows with an accuracy curve, in the order of
    accuracy_curves.png's grid (worker counts down, bandwidths across)."""
    panels: dict = {}
    for r in ok_rows(rows):
        if curve_of(r):
            panels.setdefault((int(r["np"]), r["bandwidth"]), []).append(r)
    bands = list(dict.fromkeys(bw for _, bw in panels))
    return {key: panels[key] for key in sorted(panels, key=lambda k: (k[0], bands.index(k[1])))}


def _plot_curves(plt, path: Path, panels: dict, methods: list[str], target: float | None) -> str:
    """Test accuracy against training time, one line per run, one panel per np x bandwidth."""
    nps = list(dict.fromkeys(n for n, _ in panels))
    bands = list(dict.fromkeys(bw for _, bw in panels))
    fig, axes = plt.subplots(len(nps), len(bands), figsize=(5.2 * len(bands), 3.8 * len(nps)),
                             squeeze=False, sharey=True)
    colors = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    for i, n in enumerate(nps):
        for j, bw in enumerate(bands):
            ax = axes[i][j]
            if (n, bw) not in panels:
                ax.set_visible(False)
                continue
            for r in panels[(n, bw)]:
                pts = curve_of(r)
                ax.plot([p["seconds"] for p in pts], [p["test_accuracy"] for p in pts], marker="o",
                        markersize=3, color=colors(methods.index(method(r)) % colors.N), label=method(r))
            if target is not None:
                ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"target {target:g}")
            ax.set_title(f"np {n}, links: {bw}")
            ax.set_xlabel("training time (s)")
            ax.set_ylabel("test accuracy")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# -- the cost model on measured rows -------------------------------------------------------
def _specs(text: str) -> list:
    """The specs a ``--compression`` value names (a mapping: each of its rules')."""
    from ..core.policy import Policy
    return Policy(text).known_specs()


def _collective(spec: str) -> str:
    from ..core import build
    summable = all(build(s).summable for s in _specs(spec))
    return costmodel.ALLREDUCE if summable else costmodel.ALLGATHER


def _messages(spec: str) -> float:
    """Latency-bound messages per step: Horovod fuses a step's tensors into one
    collective per cycle, so one per round (PowerSGD: two), not one per tensor."""
    return 2.0 if any(p.name == "powersgd" or p.params.get("sum") == "int"
                      for s in _specs(spec) for p in s.parts) else 1.0


def _lane_m(spec: str) -> int:
    """The largest integer code when every tensor's codes are summed as integers (the lane
    width then grows with the worker count), else 0."""
    from ..core import build
    comps = [build(s) for s in _specs(spec)]
    return max(c.m for c in comps) if comps and all(c.integer_sum for c in comps) else 0


def _rate(r: dict) -> float:
    return math.inf if r["bandwidth"] == UNCAPPED else netcap.parse_rate(r["bandwidth"])


def hierarchical_row(r: dict) -> bool:
    """Whether a run's compressed tensors took the hierarchical exchange (in simulated
    nodes; the wrapper says ``hierarchical`` for ``none`` too, whose tensors go flat)."""
    return nodes_of(r) > 1 and str(r.get("hierarchical", "")).lower() in ("true", "1") and \
        takes_hierarchy(r["compression"])


def variant(r: dict) -> str:
    """A row's exchange for the cost model: its compression, marked when hierarchical."""
    return r["compression"] + (HIER_MARK if hierarchical_row(r) else "")


#: how prediction.md names a compressor's hierarchical exchange
HIER_MARK = " (hierarchical)"


def _per_node(r: dict) -> int:
    return int(r["np"]) // nodes_of(r) if nodes_of(r) > 1 else 1


def _sample(r: dict) -> costmodel.Sample:
    return costmodel.Sample(_collective(r["compression"]), int(r["np"]), _f(r, "bytes_per_step") or 0.0,
                            _rate(r), _messages(r["compression"]), (_f(r, "comm_ms") or 0.0) / 1e3,
                            r["compression"], (_f(r, "step_ms") or 0.0) / 1e3, _per_node(r),
                            hierarchical_row(r), _f(r, "local_bytes_per_step") or 0.0)


#: per-message-step latency assumed when the runs cannot tell it (one worker count):
#: a switched Ethernet hop with Gloo's software on top
DEFAULT_ALPHA_US = 50.0


def _fixed_alpha(rows: list[dict], alpha_us: float | None) -> float | None:
    """The alpha to fix (seconds), or None to fit it: it can be fitted only from runs at
    two or more worker counts above one."""
    if alpha_us is not None:
        return alpha_us * 1e-6
    counts = {int(r["np"]) for r in rows if int(r["np"]) > 1 and r["bandwidth"] != UNCAPPED}
    return None if len(counts) >= 2 else DEFAULT_ALPHA_US * 1e-6


def _fit(rows: list[dict], alpha_s: float | None = None):
    """Links and per-compressor offsets (:func:`costmodel.fit_model`) from runs with
    more than one worker, uncapped ones included (they pin the offsets)."""
    return costmodel.fit_model([_sample(r) for r in rows if int(r["np"]) > 1], alpha_s)


def _predict_step(fitted, base: costmodel.Profile, r: dict) -> float:
    links, offsets = fitted
    prof = dataclasses.replace(base, comm_offset_ms=1e3 * offsets.get(r["compression"], 0.0))
    return costmodel.StepModel(links, {"x": prof}).step_ms("x", int(r["np"]), _rate(r), _per_node(r))


def _dense_bytes(rows: list[dict]) -> float:
    """The float32 gradient's bytes: 4 per parameter where the runs say, else what
    ``none`` sends (0: unknown)."""
    for r in rows:
        if _f(r, "parameters"):
            return 4.0 * _f(r, "parameters")
    return max([_f(r, "bytes_per_step") or 0.0 for r in rows if r["compression"] == "none"], default=0.0)


def _profile(r: dict, dense: float = 0.0) -> costmodel.Profile:
    step = _f(r, "step_ms") or 0.0
    return costmodel.Profile(r["compression"], _collective(r["compression"]), _f(r, "compute_ms") or 0.0,
                             _f(r, "encode_ms") or 0.0, _f(r, "decode_ms") or 0.0,
                             _f(r, "bytes_per_step") or 0.0, _messages(r["compression"]),
                             int(r["np"]), (_f(r, "images_per_sec_per_worker") or 0.0) * step / 1e3,
                             lane_m=_lane_m(r["compression"]), per_node=_per_node(r),
                             hierarchical=hierarchical_row(r),
                             local_bytes=_f(r, "local_bytes_per_step") or 0.0, dense_bytes=dense)


def time_to_target_lines(rows: list[dict], model, target: float, ps, bws) -> list[str]:
    """prediction.md's time-to-accuracy table: per compressor with a sync run that reached
    ``target``, the epochs it took (measured: the median over its runs that got there)
    times one epoch's images over the predicted images/s at ``p`` workers and bandwidth
    ``B``.  The assumption, stated in the table's heading: the epochs to the target
    depend on the method, not on the link (it changes no arithmetic) nor on the worker
    count (which changes the global batch: a new ``--np`` should be measured once)."""
    epochs, per_epoch = {}, []
    for r in rows:
        if r.get("epochs_to_target") in (None, "") or r["compression"] not in model.profiles:
            continue
        epochs.setdefault(r["compression"], []).append(int(float(r["epochs_to_target"])))
        curve = curve_of(r)
        if curve and _f(r, "images_per_sec"):
            per_epoch.append(_f(r, "images_per_sec") * curve[-1]["seconds"] / curve[-1]["epoch"])
    if not epochs or not per_epoch:
        return [f"No sync run reached the target accuracy {target:g}: no time to predict.", ""]
    images = sorted(per_epoch)[len(per_epoch) // 2]
    head = ["compression", "epochs to target"] + [f"p={p} {netcap.format_rate(b)}" for p in ps
                                                   for b in bws]
    out = [f"## Predicted time to {target:g} test accuracy (seconds of training)", "",
           "Epochs to the target measured (the median over a compressor's runs that reached "
           f"it), one epoch = {images:,.0f} images, step time predicted. Assumed: the epochs "
           "to the target do not change with the bandwidth (the link changes no arithmetic) "
           "nor with the worker count (which changes the global batch; measure a new np once).",
           "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for spec, got in epochs.items():
        e = sorted(got)[len(got) // 2]
        cells = [f"{e * images / model.images_per_sec(spec, p, b):.1f}" for p in ps for b in bws]
        out.append(f"| `{spec}` | {e} | " + " | ".join(cells) + " |")
    return out + [""]


#: the predictions' nodes: workers per node, and the links inside a node (PCIe 4 x16
#: class; NVLink is several times faster)
DEFAULT_PER_NODE, DEFAULT_LOCAL_BPS = 8, 2e11
#: the node table's worker counts and links between nodes
NODE_PS, NODE_BWS = (8, 64, 256, 1024), (1e10, 2.5e10, 1e11)


def predict(rows: list[dict], alpha_us: float | None = None, target: float | None = None,
            per_node: int = DEFAULT_PER_NODE, local_bps: float = DEFAULT_LOCAL_BPS,
            ) -> tuple[str, list[str]]:
    """(prediction.md text, lines worth printing).  ``alpha_us``: the per-message-step
    latency to assume (default: fitted when the runs cover two or more worker counts,
    else :data:`DEFAULT_ALPHA_US`).  Only sync-mode rows are used: the model is one exchange
    per step.  ``target``: also predict the time to that test accuracy
    (:func:`time_to_target_lines`).  Runs in simulated nodes (``--nodes``) count with
    their exchange (hierarchical or flat, :func:`variant`); ``per_node`` and ``local_bps``
    set the nodes of the node table (:func:`node_lines`)."""
    rows = [r for r in ok_rows(rows) if mode_of(r) in (SYNC, FLAT)]
    capped = [r for r in rows if r["bandwidth"] != UNCAPPED and int(r["np"]) > 1 and not r.get("latency")]
    uncapped = [r for r in rows if r["bandwidth"] == UNCAPPED]
    md, say = ["# Cost model", ""], []
    if not uncapped:
        return "# Cost model\n\nNo uncapped run succeeded: nothing to fit.\n", ["predict: no uncapped runs"]
    # per compressor: the uncapped run at the largest worker count stands for a worker's costs
    profiles, at_np = {}, {}
    dense = _dense_bytes(rows)
    for r in sorted(uncapped, key=lambda r: int(r["np"])):
        profiles[variant(r)] = _profile(r, dense)
        at_np[(variant(r), int(r["np"]), nodes_of(r))] = _profile(r, dense)
    multi = [r for r in rows if int(r["np"]) > 1 and not r.get("latency")]
    alpha = _fixed_alpha(capped, alpha_us)
    fitted = _fit(multi, alpha) if multi else ({}, {})
    links, offsets = fitted
    if capped:
        md += [f"Fitted to {len(multi)} run(s) with more than one worker ({len(capped)} capped): "
               + "; ".join(
            f"{coll}: alpha = {lk.alpha_s * 1e3:.2f} ms per message step, eta = {lk.efficiency:.3f} x "
            "the nominal rate" for coll, lk in links.items()) + "." + (
                "" if alpha is None else f" Alpha is fixed at {alpha * 1e6:.0f} us (the runs cover one "
                "worker count, where alpha times the hops is a constant the offsets take up; "
                "`--alpha-us` sets it for your network, runs at several worker counts fit it)."), "",
            "Per-compressor offsets (ms; what the collective costs besides the link, less what hides "
            "behind the backward pass): " + ", ".join(f"`{k}` {1e3 * v:+.1f}" for k, v in offsets.items()),
            ""]
    else:
        links = {coll: costmodel.Link(alpha_s=0.0, efficiency=1.0)
                 for coll in (costmodel.ALLREDUCE, costmodel.ALLGATHER)}
        md += ["No capped run: the link cannot be fitted; assumed alpha = 0 and the nominal rate "
               "(efficiency 1). Run with `--bandwidth` (as root) for a fitted model.", ""]
    md += ["Step = compute + encode + decode(p) + wait(p, B); wait = max(0, offset + transfer), transfer "
           "by ring allreduce 2(p-1)/p*S*8/(eta*B) + 2(p-1)*alpha per collective or allgather "
           "(p-1)*S*8/(eta*B) + (p-1)*alpha; allgather decoding grows with p. Each compressor's compute, "
           "encode, decode and bytes are its uncapped run at the largest worker count (np "
           f"{max(int(r['np']) for r in uncapped)} here); on this machine workers share the cores, "
           "so compute is that of a worker with a share of them.", ""]

    # validation: each capped run predicted by a fit made without it
    md += ["## Validation on capped runs (leave one out)", ""]
    errors = []
    if len(capped) >= 2:
        md += ["| compression | np | bandwidth | measured step ms | predicted ms | error |",
               "|---|---|---|---|---|---|"]
        for r in capped:
            base = at_np.get((variant(r), int(r["np"]), nodes_of(r)))
            if base is None:
                continue
            pred = _predict_step(_fit([o for o in multi if o is not r], alpha), base, r)
            meas = _f(r, "step_ms")
            err = (pred - meas) / meas
            errors.append(abs(err))
            md.append(f"| `{r['compression']}` | {r['np']} | {r['bandwidth']} | {meas:.1f} | {pred:.1f} | "
                      f"{100 * err:+.1f}% |")
        if errors:
            within = sum(e <= 0.25 for e in errors)
            line = (f"cost model: predicted {len(errors)} capped runs it was not fitted on; median error "
                    f"{100 * sorted(errors)[len(errors) // 2]:.1f}%, worst {100 * max(errors):.1f}%, "
                    f"{within}/{len(errors)} within 25%")
            md += ["", line, ""]
            say.append(line)
    else:
        md += ["Fewer than two capped runs: nothing to validate on.", ""]
        say.append("cost model: fewer than two capped runs, not validated")

    # validation across bandwidths: fitted without any run at this rate, predict them
    rates = sorted({r["bandwidth"] for r in capped}, key=netcap.parse_rate)
    if len(rates) >= 2:
        md += ["## Validation across bandwidths (fitted without any run at the predicted rate)", "",
               "| predicted rate | fitted on | runs | median error | worst error | within 25% |",
               "|---|---|---|---|---|---|"]
        for rate in rates:
            test = [r for r in capped if r["bandwidth"] == rate and
                    (variant(r), int(r["np"]), nodes_of(r)) in at_np]
            if not test:
                continue
            without = _fit([o for o in multi if o["bandwidth"] != rate], alpha)
            errs = sorted(abs(_predict_step(without, at_np[(variant(r), int(r["np"]), nodes_of(r))], r)
                              - _f(r, "step_ms")) / _f(r, "step_ms") for r in test)
            within = sum(e <= 0.25 for e in errs)
            others = ", ".join(["uncapped"] + [o for o in rates if o != rate])
            md.append(f"| {rate} | {others} | {len(errs)} | {100 * errs[len(errs) // 2]:.1f}% | "
                      f"{100 * errs[-1]:.1f}% | {within}/{len(errs)} |")
            say.append(f"cost model: {rate} runs predicted without any {rate} run: median error "
                       f"{100 * errs[len(errs) // 2]:.1f}%, worst {100 * errs[-1]:.1f}%, "
                       f"{within}/{len(errs)} within 25%")
        md.append("")

    # predictions
    profiles = {k: dataclasses.replace(v, comm_offset_ms=1e3 * offsets.get(v.compression, 0.0))
                for k, v in profiles.items()}
    model = costmodel.StepModel(links, profiles)
    bws = [1e8, 1e9, 1e10, 1e11]
    ps = [2, 8, 64, 1024]
    md += ["## Predicted images/s (all workers) and speed-up over none", ""]
    head = ["compression"] + [f"p={p} {netcap.format_rate(b)}" for p in ps for b in bws]
    md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    has_none = "none" in profiles
    flat = [k for k in profiles if not k.endswith(HIER_MARK)]  # one worker a link: no nodes
    for spec in flat:
        cells = []
        for p in ps:
            for b in bws:
                ips = model.images_per_sec(spec, p, b)
                rel = ips / model.images_per_sec("none", p, b) if has_none else float("nan")
                cells.append(f"{ips:.0f}" + (f" ({rel:.2f}x)" if has_none else ""))
        md.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    md.append("")
    if has_none:
        md += ["## Crossover bandwidths", ""]
        for spec in flat:
            if spec == "none":
                continue
            for p in ps:
                kind, bps = costmodel.crossover(model, spec, p)
                if kind == "below":
                    text = f"{spec} beats none below {bps / 1e9:.3g} Gbit/s at {p} workers"
                elif kind == "above":
                    text = f"{spec} beats none above {bps / 1e9:.3g} Gbit/s at {p} workers"
                elif kind == "always":
                    text = f"{spec} beats none at every bandwidth from 1 Mbit/s to 1 Tbit/s at {p} workers"
                else:
                    text = f"{spec} never beats none between 1 Mbit/s and 1 Tbit/s at {p} workers"
                md.append(f"- {text}")
                if p == 8:
                    say.append(text)
        md.append("")
    if has_none:
        got, lines = node_lines(model, per_node, local_bps)
        md += got
        say += lines
    if target is not None:
        md += time_to_target_lines(add_targets([dict(r) for r in rows], target), model, target,
                                   ps, bws)
    return "\n".join(md), say


def node_lines(model: costmodel.StepModel, per_node: int, local_bps: float) -> tuple[list[str], list[str]]:
    """prediction.md's table for clusters of nodes: predicted images/s (and the speed-up
    over ``none``) of every exchange measured, at :data:`NODE_PS` workers in nodes of
    ``per_node`` and :data:`NODE_BWS` between nodes, the best per column, and the worker
    counts (``per_node`` times powers of 2, to 1,024 nodes) at which each beats ``none``.
    (Lines for prediction.md, lines worth printing.)"""
    L = per_node
    scan = [L * 2 ** k for k in range(11)]
    specs = list(model.profiles)

    def ips(spec, p, b):
        return model.images_per_sec(spec, p, b, L, local_bps)

    head = ["exchange"] + [f"p={p} {netcap.format_rate(b)}" for p in NODE_PS for b in NODE_BWS]
    md = [f"## Nodes of {L}: predicted images/s (all workers) and speed-up over none", "",
          f"{L} workers a node, the links inside a node at {netcap.format_rate(local_bps)} "
          f"(`--local-bandwidth`), the node's link to the others at the rate in the column; at "
          f"p = {L} the job is one node and every collective runs inside it. The hierarchical "
          "exchange (dense inside the node, compressed between nodes) and the flat one are rows "
          "of their own where measured; a worker's compute, encode and decode are as measured, "
          "encode and decode scaled to the shard a worker holds (1/L of a tensor, hierarchical) "
          "and to the payloads it decodes.", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = {}
    for spec in specs:
        cells = []
        for p in NODE_PS:
            for b in NODE_BWS:
                v, base = ips(spec, p, b), ips("none", p, b)
                cells.append(f"{v:.0f} ({v / base:.2f}x)")
                if (p, b) not in best or v > best[(p, b)][1]:
                    best[(p, b)] = (spec, v, v / base)
        md.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    md.append("| **best** | " + " | ".join(f"`{best[(p, b)][0]}` ({best[(p, b)][2]:.2f}x)"
                                          for p in NODE_PS for b in NODE_BWS) + " |")
    md += ["", f"### Worker counts at which each beats none (nodes of {L}, {L} to {scan[-1]:,} workers)",
           "", "| exchange | " + " | ".join(netcap.format_rate(b) for b in NODE_BWS) + " |",
           "|---|" + "---|" * len(NODE_BWS)]
    say = []
    for spec in specs:
        if spec == "none":
            continue
        cells = []
        for b in NODE_BWS:
            wins = [p for p in scan if ips(spec, p, b) > ips("none", p, b)]
            if not wins:
                cells.append("never")
                continue
            stop = next((p for p in scan if p > wins[0] and p not in wins), None)
            cells.append(f"from {wins[0]:,}" + (f", stops at {stop:,}" if stop else
                                                f", still at {scan[-1]:,}"))
        md.append(f"| `{spec}` | " + " | ".join(cells) + " |")
        say.append(f"nodes of {L}, {netcap.format_rate(NODE_BWS[0])}: {spec} beats none "
                   + cells[0].replace("never", "at no worker count"))
    p, b = NODE_PS[-1], NODE_BWS[0]
    say.append(f"nodes of {L}: best at {p} workers and {netcap.format_rate(b)}: "
               f"{best[(p, b)][0]} ({best[(p, b)][2]:.2f}x none)")
    return md + [""], say


# -- command line ----------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hvd-compress-compare", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compression", nargs="+", type=runtools.spec_arg, default=DEFAULT_COMPRESSIONS,
                    metavar="SPEC", help="compressor specs, or per-tensor mappings "
                    "'pattern=spec;pattern=spec' (default: %(default)s)")
    ap.add_argument("--np", nargs="+", type=runtools.positive_int, default=[1, 2],
                    help="worker counts (default: 1 2)")
    ap.add_argument("--bandwidth", nargs="+", default=[UNCAPPED, "1gbit", "200mbit"], metavar="RATE",
                    help="'uncapped' and/or link rates such as 100mbit 1gbit 10gbit "
                         "(default: uncapped 1gbit 200mbit; capped rates need root)")
    ap.add_argument("--latency", default="", metavar="DELAY",
                    help="added one-way delay on capped links, e.g. 1ms (default none)")
    ap.add_argument("--example", choices=sorted(EXAMPLES), default="synthetic",
                    help="which example to run (default synthetic)")
    ap.add_argument("--framework", choices=sorted(FRAMEWORK_DIRS), default="torch",
                    help="(default torch)")
    ap.add_argument("--example-args", default=None, metavar="ARGS",
                    help="arguments for the example instead of the defaults (one quoted string); "
                         "defaults: " + "; ".join(f"{k}: {v}" for k, v in DEFAULT_EXAMPLE_ARGS.items()))
    ap.add_argument("--min-numel", type=runtools.nonnegative_int, default=None, metavar="N",
                    help="passed to every run: tensors with fewer elements travel uncompressed "
                         "(the examples' default 1024; 0: compress every tensor)")
    ap.add_argument("--start-step", type=runtools.nonnegative_int, default=None, metavar="N",
                    help="passed to every run: uncompressed for the first N steps (default 0)")
    ap.add_argument("--local-sgd", nargs="+", type=runtools.positive_int, default=None, metavar="H",
                    help="also run local SGD, averaging every H steps, for each H (a mode; "
                         "at more than one worker)")
    ap.add_argument("--delay", nargs="+", type=runtools.nonnegative_int, default=None, metavar="D",
                    help="also run Delayed Gradient Averaging with each delay D (a mode; 0 is sync; "
                         "at more than one worker; one-round compressors only)")
    ap.add_argument("--modes-for", nargs="+", default=None, metavar="SPEC",
                    help="run the --local-sgd and --delay modes only for these of the "
                         "--compression specs (default: for all)")
    ap.add_argument("--nodes", type=runtools.positive_int, default=1, metavar="N",
                    help="simulated nodes: each --np count (above 1, a multiple of N) runs as N "
                         "nodes of np/N workers -- capped runs: one network namespace per node, "
                         "the links between nodes capped, the workers of a node talking "
                         "uncapped inside it; uncapped runs: on loopback, Horovod seeing the "
                         "nodes -- and every compressor that gathers or sums integers runs twice: "
                         "hierarchical (mode sync) and flat (mode flat) (default 1)")
    ap.add_argument("--strategy", choices=("horovod", "mwms"), default="horovod",
                    help="mwms: also run TensorFlow's MultiWorkerMirroredStrategy (no Horovod, "
                         "uncompressed) as a baseline row per worker count and bandwidth "
                         "(--example digits or digits-wide; always the TensorFlow example, "
                         "compared with the Horovod runs of --framework, torch too)")
    ap.add_argument("--target-accuracy", type=float, default=None, metavar="A",
                    help="test accuracy in (0, 1] to time: adds time and epochs to it per run and the "
                         "fastest method to it per setting (examples with accuracy: digits, "
                         "digits-wide, cifar10)")
    ap.add_argument("--stop-at-target", action="store_true",
                    help="with --target-accuracy: every run stops after the first epoch that "
                         "reaches it (the examples' --stop-at), so the curves end there and a "
                         "time-to-accuracy matrix takes less time; runs that never reach it "
                         "train every epoch")
    ap.add_argument("--out", required=True, metavar="DIR", help="folder for results and plots")
    ap.add_argument("--resume", action="store_true",
                    help="keep the successful runs already in DIR/results.csv; run the rest")
    ap.add_argument("--predict", action="store_true",
                    help="fit the cost model and write DIR/prediction.md")
    ap.add_argument("--alpha-us", type=float, default=None, metavar="US",
                    help="with --predict: latency per message step in microseconds (default: "
                         f"fitted from runs at two or more worker counts, else {DEFAULT_ALPHA_US:g})")
    ap.add_argument("--per-node", type=runtools.positive_int, default=DEFAULT_PER_NODE, metavar="L",
                    help="with --predict: workers per node in the table for clusters of nodes "
                         f"(default {DEFAULT_PER_NODE})")
    ap.add_argument("--local-bandwidth", default=netcap.format_rate(DEFAULT_LOCAL_BPS), metavar="RATE",
                    help="with --predict: the links inside a node in that table (default "
                         f"{netcap.format_rate(DEFAULT_LOCAL_BPS)})")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds before one run is stopped and recorded as timed out (default 900)")
    ap.add_argument("--quiet", action="store_true", help="no progress display")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        args.bandwidth = [bandwidth_label(b) for b in args.bandwidth]
        if args.latency:
            netcap.parse_latency(args.latency)
        netcap.parse_rate(args.local_bandwidth)
    except ValueError as exc:
        ap.error(str(exc))
    if args.alpha_us is not None and not (math.isfinite(args.alpha_us) and args.alpha_us >= 0):
        ap.error(f"--alpha-us must be a number >= 0, got {args.alpha_us}")
    if args.example == "cifar10" and (args.example_args is None or "--data-dir" not in args.example_args):
        ap.error("--example cifar10 needs --example-args '--data-dir DIR ...'")
    if args.target_accuracy is not None:
        try:
            check_target(args.target_accuracy)
        except ValueError as exc:
            ap.error(str(exc))
        if args.example == "synthetic":
            ap.error("--target-accuracy needs an example that reports test accuracy (--example digits "
                     "or cifar10); the synthetic benchmark has none")
    if args.stop_at_target and args.target_accuracy is None:
        ap.error("--stop-at-target needs --target-accuracy A")
    if args.modes_for:
        if not (args.local_sgd or args.delay):
            ap.error("--modes-for needs --local-sgd or --delay")
        stray = [s for s in args.modes_for if s not in args.compression]
        if stray:
            ap.error(f"--modes-for names specs that --compression does not: {' '.join(stray)}")
    if args.nodes > 1 and any(n > 1 and n % args.nodes for n in args.np):
        ap.error(f"--np counts above 1 must be multiples of --nodes {args.nodes}")
    if args.nodes > 1 and args.strategy == "mwms":
        ap.error("--strategy mwms runs without --nodes")
    if args.strategy == "mwms" and args.example not in MWMS_EXAMPLES:
        ap.error("--strategy mwms runs with --example " + " or ".join(MWMS_EXAMPLES))
    try:
        check_modes(args.modes_for or args.compression,
                    run_modes(args.local_sgd, args.delay, args.strategy))
    except ValueError as exc:
        ap.error(str(exc))
    try:
        for framework in {args.framework} | ({"tensorflow"} if args.strategy == "mwms" else set()):
            examples_dir(framework)
    except FileNotFoundError as exc:
        ap.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    capped_ok, why = netcap.available()
    if any(b != UNCAPPED for b in args.bandwidth) and not capped_ok:
        print(f"compare: {why}; running uncapped only", file=sys.stderr, flush=True)
    if 1 in args.np and any(b != UNCAPPED for b in args.bandwidth):
        print("compare: np 1 runs once, uncapped (a single worker sends nothing)", flush=True)
    runs = plan_runs(args, capped_ok)
    csv_path = out / "results.csv"
    rows = read_csv(csv_path) if args.resume else []
    for r in rows:
        r["mode"] = mode_of(r)  # results from before modes: sync
    done = {run_key(r) for r in rows if r.get("status") == "ok"}
    rows = [r for r in rows if r.get("status") == "ok"]
    todo = [r for r in runs if run_key(r) not in done]
    if args.resume:
        print(f"compare: resuming; {len(runs) - len(todo)} of {len(runs)} runs already done", flush=True)
    progress = runtools.Progress(len(todo), "runs", enabled=not args.quiet, stream=sys.stdout)
    progress.update(0)
    failed = 0
    for i, run in enumerate(todo):
        row = add_targets([execute(args, run, out)], args.target_accuracy)[0]
        rows.append(row)
        write_csv(csv_path, rows)
        if row["status"] != "ok":
            failed += 1
        note = f"{method(run)} np {run['np']} {run['bandwidth']}: " + (
            f"{float(row['images_per_sec']):.1f} img/s" if row["status"] == "ok" else row["status"])
        progress.update(i + 1, note)
    order = {run_key(r): i for i, r in enumerate(runs)}
    rows.sort(key=lambda r: order.get(run_key(r), len(order)))
    add_targets(rows, args.target_accuracy)
    write_csv(csv_path, rows)
    write_markdown(out / "results.md", rows, args.target_accuracy, args.stop_at_target)
    files = [str(csv_path), str(out / "results.md")] + plot(out, rows, args.target_accuracy)
    print((out / "results.md").read_text(), flush=True)
    if args.predict:
        text, say = predict(rows, args.alpha_us, args.target_accuracy, args.per_node,
                            netcap.parse_rate(args.local_bandwidth))
        (out / "prediction.md").write_text(text)
        files.append(str(out / "prediction.md"))
        for line in say:
            print(line, flush=True)
    print("wrote: " + ", ".join(files), flush=True)
    if failed:
        print(f"compare: {failed} run(s) failed; see the status column and their logs", flush=True)
    return 1 if failed == len(todo) and todo else 0


if __name__ == "__main__":
    sys.exit(main())
