"""Launching one run of a comparison: the example script's command line, under
``horovodrun --gloo`` (uncapped; ``-H`` the user's hosts), :mod:`.nodesrun` (simulated nodes),
:mod:`.mwms` (TensorFlow's strategy) or in capped namespaces (:mod:`.netcap`), and
its ``--json`` summary read back into the run's CSV row."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from . import hvdrun, netcap, runtools
from .plan import (
    COLUMNS,
    DEFAULT_EXAMPLE_ARGS,
    EXAMPLES,
    FRAMEWORK_DIRS,
    MWMS,
    RUN_KEYS,
    TORCH_ONLY,
    UNCAPPED,
    device_of,
    mode_flags,
    mode_of,
    nodes_of,
    optimizer_of,
    run_name,
)
from .runrow import RunRow

TOOLS_DIR = Path(__file__).resolve().parent
#: how long Gloo waits for a peer in every run, unless the environment says
#: (``HOROVOD_GLOO_TIMEOUT_SECONDS``; Horovod's default is 30 s): on shared cores one
#: rank's first kernel compiles kept the others waiting past 30 s, and the run aborted
GLOO_TIMEOUT_ENV, GLOO_TIMEOUT_S = "HOROVOD_GLOO_TIMEOUT_SECONDS", 120


def examples_dir(framework: str, tools_dir: Path | None = None) -> Path:
    """The folder holding ``framework``'s example scripts.

    First a checkout's own (``<repo>/torch_examples`` beside ``<repo>/hvd_compress``),
    so that edits to the examples are what runs; else the copy an installed package
    carries (``hvd_compress/tools/examples/torch_examples``, made by setup.py's
    build step).  ``tools_dir``: this sub-package's folder (default: where this
    module lies).  A folder counts only if it holds every example script of the framework
    (:func:`scripts_of`)."""
    tools_dir = Path(tools_dir) if tools_dir is not None else TOOLS_DIR
    name = FRAMEWORK_DIRS[framework]
    candidates = (tools_dir.parents[1] / name, tools_dir / "examples" / name)
    for folder in candidates:
        if all((folder / script).is_file() for script in scripts_of(framework)):
            return folder
    raise FileNotFoundError(
        f"cannot find the {framework} example scripts ({', '.join(scripts_of(framework))}): "
        f"looked in {candidates[0]} (a checkout of the repository) and in {candidates[1]} "
        "(the copy an installed package carries); run from a checkout, or install hvd-compress "
        "from its repository or a wheel built from it")


def scripts_of(framework: str) -> list[str]:
    """The example scripts ``framework``'s folder holds (TensorFlow's lacks the PyTorch-only
    ones, :data:`~hvd_compress.tools.plan.TORCH_ONLY`)."""
    return sorted({script for example, script in EXAMPLES.items()
                   if framework == "torch" or example not in TORCH_ONLY})


def example_command(args, run, json_path: Path) -> list[str]:
    """The example's command line for ``run`` (a :class:`RunRow`, or a dict of its keys)."""
    run = RunRow.of(run)
    script = examples_dir(run.framework) / EXAMPLES[run.example]
    extra = shlex.split(args.example_args if args.example_args is not None
                        else DEFAULT_EXAMPLE_ARGS[run.example])
    for flag in ("min_numel", "start_step"):  # the per-tensor policy's knobs, when given
        if getattr(args, flag, None) is not None:
            extra += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    # simulated nodes pick the exchange of each mode; real hosts (--hosts) run the default
    extra += mode_flags(mode_of(run), 1 if run.hosts else nodes_of(run), int(run.np or 0))
    if optimizer_of(run):
        extra += ["--optimizer", optimizer_of(run)]
    if getattr(args, "target_loss", None) is not None:  # (the example reports the time to it too)
        extra += ["--target-loss", f"{args.target_loss:g}"]
        extra += ["--stop-at-target"] if getattr(args, "stop_at_target", False) else []
    elif getattr(args, "stop_at_target", False):
        extra += ["--stop-at", f"{args.target_accuracy:g}"]
    return [sys.executable, str(script), *extra, "--compression", run.compression,
            "--device", device_of(run), "--json", str(json_path), "--quiet"]


def horovodrun() -> list[str]:
    """How a run is launched uncapped: ``horovodrun``, less its start-up probe
    (:mod:`.hvdrun`)."""
    return hvdrun.command()


def execute(args, run, out: Path) -> RunRow:
    """Launch one run (a :class:`RunRow`, or a dict of its keys); returns its CSV row
    (status ok or failed)."""
    run = RunRow.of(run)
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
        if run.bandwidth == UNCAPPED:
            if run.hosts:  # the user's hosts (tools.hosts), as horovodrun places the ranks
                full = [*horovodrun(), "-np", str(run.np), "-H", run.hosts, "--gloo", *cmd]
            elif mode_of(run) == MWMS:
                full = [sys.executable, "-m", "hvd_compress.tools.mwms", "-np", str(run.np), *cmd]
            elif nodes_of(run) > 1:  # Horovod sees the nodes; loopback links
                full = [sys.executable, "-m", "hvd_compress.tools.nodesrun", "--nodes",
                        str(nodes_of(run)), "-np", str(run.np), *cmd]
            else:
                full = [*horovodrun(), "-np", str(run.np), "-H", f"localhost:{run.np}",
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
            latency = netcap.parse_latency(run.latency) if run.latency else 0.0
            nodes = nodes_of(run)
            per = int(run.np) // nodes if nodes > 1 else 1  # workers per namespace
            where = f"{nodes} namespaces of {per} workers" if nodes > 1 else f"{run.np} namespaces"
            with open(log_path, "w") as log:
                log.write(f"# {where}, links capped at {run.bandwidth}"
                          f"{', latency ' + run.latency if latency else ''}\n$ "
                          + shlex.join(cmd) + "\n")
            with netcap.CappedNetwork(nodes if nodes > 1 else run.np,
                                      netcap.parse_rate(run.bandwidth), latency) as net:
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
    row = run.copy()
    row.log = str(log_path)
    if rc == 0 and json_path.exists():
        doc = json.loads(json_path.read_text())
        for key in COLUMNS:
            if key in doc and key not in RUN_KEYS:
                row[key] = doc[key]
        if doc.get(runtools.CURVE) is not None:  # one CSV cell
            row.curve = json.dumps(doc[runtools.CURVE], separators=(",", ":"))
        row.step_ms = doc["step_ms"] if doc.get("step_ms") is not None else round(
            sum(float(doc.get(k) or 0.0) for k in ("compute_ms", "encode_ms", "comm_ms", "decode_ms")), 3)
        row.status = "ok"
    else:
        row.status = ("timed out" if rc == 124 else f"failed (exit {rc})") + f"; see {log_path}"
        row.wall_s = round(wall, 3)
    return row
