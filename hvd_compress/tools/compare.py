"""Compare compressors over worker counts and link bandwidths with real Horovod runs.

    hvd-compress-compare --out results                       # the small default matrix
    hvd-compress-compare --example digits --np 1 2 --compression none topk:ratio=0.01 \\
        --bandwidth uncapped 1gbit --out results-digits --predict

For each compressor spec x mode x worker count (``--np``) x bandwidth
(``--bandwidth``; ``uncapped`` or a rate such as ``100mbit``/``1gbit``) this
launches one of the
examples (``--example synthetic|digits|cifar10|lm``, ``--framework
torch|tensorflow``; ``lm``, the transformer language model, is PyTorch's) under
Horovod -- ``horovodrun --gloo`` when uncapped; with a rate, one network namespace per
worker behind ``tc``-capped links
(:mod:`hvd_compress.tools.netcap`, needs root); with ``--hosts h1:4,h2:4`` or
``--hostfile PATH``, on those hosts through ``horovodrun -H`` (uncapped; the rows record
the layout: :mod:`hvd_compress.tools.hosts`) -- and collects the example's
``--json`` summary.  The modes: ``sync`` (ordinary synchronous training) always,
then local SGD for each period of ``--local-sgd H ...``, DiLoCo for each period of
``--diloco H ...`` (the language model) and Delayed Gradient
Averaging for each delay of ``--delay D ...`` (at more than one worker: for a
single worker both are plain SGD; ``--modes-for SPEC ...`` runs them for those
compressors only), and TensorFlow's MultiWorkerMirroredStrategy with ``--strategy
mwms`` (the TensorFlow example, a baseline row per setting).  The language model
also takes ``--optimizer adamw onebit-adam zeroone-adam``: AdamW runs every compressor and
mode, 1-bit Adam and 0/1 Adam a row each per setting (``efsignsgd`` by the two-phase
exchange), and ``--target-loss L`` times each run to a validation loss.  With
``--target-accuracy A --stop-at-target`` every run stops at the first epoch that
reaches A (a time-to-accuracy matrix need not train on).  Every run trains on
``--device cuda`` (each worker on GPU local_rank % GPUs: the workers of one machine may
share one GPU) or ``cpu``; by default cuda where the framework sees a GPU, as the
examples choose, else cpu -- decided once, before anything runs (``cuda`` where there
is none is refused there), and recorded in every row.  Into ``--out`` go:

* ``results.csv``: one row per run, the keys of the examples' ``--json``
  summary (:data:`hvd_compress.tools.runtools.SUMMARY_KEYS`) plus
  ``bandwidth``, ``latency``, ``device``, ``status`` (``ok`` or why it failed),
  ``step_ms``, ``log`` (that run's output), ``mode``, the accuracy curve
  (``curve``: JSON, the examples' test accuracy and training seconds after
  every epoch), ``best_accuracy`` and, with ``--target-accuracy A``,
  ``target_accuracy``, ``time_to_target_s`` and ``epochs_to_target`` (blank
  when the run never reached A);
* ``results.md``: the same as a Markdown table (a time split the run did not measure,
  blank in the CSV, shows ``n/m``), with the speed-up over
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
``--resume`` keeps the rows of runs that succeeded and runs only the rest (a row is
kept for a run of the same settings and device: a cpu row never stands for a cuda run).
Ctrl-C or SIGTERM stops the whole matrix within seconds (status 130 or 143): the run in
progress and every process it started (:mod:`hvd_compress.tools.stopping`) and its
namespaces go, the rows already done stay in results.csv for ``--resume``.
A single worker sends nothing, so ``--np 1`` runs once, uncapped.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from . import devices, netcap, runtools, stopping
from . import hosts as real_hosts
from .plan import (
    ADAM_COMPRESSION,
    COLUMNS,
    DEFAULT_COMPRESSIONS,
    DEFAULT_EXAMPLE_ARGS,
    EXAMPLES,
    EXCHANGE_MODES,
    FLAT,
    FRAMEWORK_DIRS,
    LOSS_EXAMPLES,
    MWMS,
    MWMS_EXAMPLES,
    OPTIMIZERS,
    RUN_KEYS,
    SYNC,
    TORCH_ONLY,
    UNCAPPED,
    bandwidth_label,
    check_modes,
    device_of,
    dga_mode,
    diloco_mode,
    local_sgd_mode,
    method,
    mode_flags,
    mode_of,
    nodes_of,
    plan_runs,
    repeat_of,
    run_key,
    run_modes,
    run_name,
    takes_hierarchy,
)
from .predict import (
    DEFAULT_ALPHA_US,
    DEFAULT_LOCAL_BPS,
    DEFAULT_PER_NODE,
    HIER_MARK,
    NODE_BWS,
    NODE_PS,
    hierarchical_row,
    node_lines,
    predict,
    time_to_target_lines,
    variant,
)
from .repeats import medians
from .report import (
    ACCURACY,
    LOSS,
    add_targets,
    best_accuracy,
    best_lines,
    check_target,
    curve_of,
    curve_panels,
    hit,
    is_baseline,
    missed,
    ok_rows,
    plot,
    reach,
    read_csv,
    setting_of,
    speedups,
    target_lines,
    write_csv,
    write_markdown,
)
from .run import GLOO_TIMEOUT_ENV, GLOO_TIMEOUT_S, example_command, examples_dir, execute, horovodrun

DEFAULT_BANDWIDTHS = [UNCAPPED, "1gbit", "200mbit"]

# The command line is here; the jobs are modules of their own: plan (what runs), run
# (launching it), report (results.csv, results.md, plots) and predict (the cost model's
# prediction.md).  Their names keep this module's address too: hvd_compress.tools.compare.X
__all__ = ["main", "parser", "COLUMNS", "DEFAULT_COMPRESSIONS", "DEFAULT_EXAMPLE_ARGS", "EXAMPLES", "FLAT",
           "FRAMEWORK_DIRS", "MWMS", "MWMS_EXAMPLES", "RUN_KEYS", "SYNC", "UNCAPPED",
           "bandwidth_label", "check_modes", "device_of", "dga_mode", "local_sgd_mode", "method",
           "mode_flags", "mode_of", "nodes_of", "plan_runs", "run_key", "run_modes", "run_name",
           "takes_hierarchy", "example_command", "examples_dir", "execute", "horovodrun",
           "add_targets", "best_accuracy", "best_lines", "check_target", "curve_of",
           "curve_panels", "hit", "is_baseline", "missed", "ok_rows", "plot", "reach", "read_csv",
           "setting_of", "speedups", "target_lines", "write_csv", "write_markdown",
           "DEFAULT_ALPHA_US", "DEFAULT_LOCAL_BPS", "DEFAULT_PER_NODE", "HIER_MARK", "NODE_BWS",
           "NODE_PS", "hierarchical_row", "node_lines", "predict", "time_to_target_lines",
           "variant", "ACCURACY", "LOSS", "LOSS_EXAMPLES", "OPTIMIZERS", "TORCH_ONLY", "diloco_mode"]


def rate_arg(text: str) -> str:
    """A link rate with its unit (``1gbit``); a bare number is refused with the forms
    accepted (tc would take ``5`` as 5 bit/s, and every capped run would fail)."""
    try:
        return netcap.format_rate(netcap.parse_rate(text, unit=True))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def bandwidth_arg(text: str) -> str:
    """``--bandwidth``'s values: ``uncapped`` (or ``none``, ``0``) or :func:`rate_arg`."""
    if text.lower() in (UNCAPPED, "none", "0"):
        return UNCAPPED
    try:
        return rate_arg(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or '{UNCAPPED}'") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hvd-compress-compare", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compression", nargs="+", type=runtools.spec_arg, default=DEFAULT_COMPRESSIONS,
                    metavar="SPEC", help="compressor specs, or per-tensor mappings "
                    "'pattern=spec;pattern=spec' (default: %(default)s)")
    ap.add_argument("--np", nargs="+", type=runtools.positive_int, default=[1, 2],
                    help="worker counts (default: 1 2)")
    ap.add_argument("--bandwidth", nargs="+", type=bandwidth_arg, default=DEFAULT_BANDWIDTHS,
                    metavar="RATE", help="'uncapped' and/or link rates with their unit such as 100mbit "
                         "1gbit 10gbit (default: uncapped 1gbit 200mbit; capped rates need root)")
    ap.add_argument("--latency", default="", metavar="DELAY",
                    help="added one-way delay on capped links, e.g. 1ms (default none)")
    ap.add_argument("--example", choices=sorted(EXAMPLES), default="synthetic",
                    help="which example to run (default synthetic)")
    ap.add_argument("--framework", choices=sorted(FRAMEWORK_DIRS), default="torch",
                    help="(default torch)")
    ap.add_argument("--device", choices=devices.DEVICES, default=None,
                    help="where every run trains: cuda (each worker on GPU local_rank %% GPUs; "
                         "the workers of one machine may share one GPU) or cpu (default: cuda "
                         "where the framework sees a GPU, else cpu; recorded in every row)")
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
    ap.add_argument("--diloco", nargs="+", type=runtools.positive_int, default=None, metavar="H",
                    help="also run DiLoCo, an outer Nesterov step every H steps, for each H (a mode; "
                         "at more than one worker; --example lm, with AdamW)")
    ap.add_argument("--fragments", type=runtools.positive_int, default=1, metavar="F",
                    help="with --diloco: Streaming DiLoCo, the parameters in F fragments synced in "
                         "turn (default 1)")
    ap.add_argument("--optimizer", nargs="+", choices=OPTIMIZERS["lm"], default=None, metavar="O",
                    help="--example lm: the optimizers to run (" + ", ".join(OPTIMIZERS["lm"])
                         + "); adamw runs every compressor and mode, 1-bit Adam and 0/1 Adam a row "
                         "each per setting, with --adam-compression by the two-phase exchange "
                         "(default: adamw)")
    ap.add_argument("--adam-compression", type=runtools.spec_arg, default=ADAM_COMPRESSION,
                    metavar="SPEC", help="what 1-bit Adam and 0/1 Adam send their momentum with "
                                         "(default %(default)s)")
    ap.add_argument("--modes-for", nargs="+", default=None, metavar="SPEC",
                    help="run the --local-sgd, --diloco and --delay modes only for these of the "
                         "--compression specs (default: for all)")
    ap.add_argument("--exchange", nargs="+", choices=EXCHANGE_MODES, default=None, metavar="E",
                    help="also run each compressor that sends packed payloads with each of these "
                         "exchanges (a mode each: " + ", ".join(EXCHANGE_MODES) + "; the "
                         "hierarchical ones need --nodes); sync runs the examples' default, "
                         "auto (under --nodes: hierarchical) (default: none)")
    ap.add_argument("--nodes", type=runtools.positive_int, default=1, metavar="N",
                    help="simulated nodes: each --np count (above 1, a multiple of N) runs as N "
                         "nodes of np/N workers -- capped runs: one network namespace per node, "
                         "the links between nodes capped, the workers of a node talking "
                         "uncapped inside it; uncapped runs: on loopback, Horovod seeing the "
                         "nodes -- and every compressor that gathers or sums integers runs twice: "
                         "hierarchical (mode sync) and flat (mode flat) (default 1)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--hosts", default=None, metavar="HOST:SLOTS,...",
                       help="run on these hosts through horovodrun -H (e.g. h1:4,h2:4): ranks fill "
                            "the hosts in order, each --np count must fit their slots; your network, "
                            "uncapped (no --bandwidth rates, no --nodes). Rank 0 writes each run's "
                            "summary into --out on the first host: list this machine first, or "
                            "use a folder every host sees; Python and the examples must be at the "
                            "same paths on every host (horovodrun starts them over ssh)")
    where.add_argument("--hostfile", default=None, metavar="PATH",
                       help="the hosts from a file in horovodrun's format: a line per host, "
                            "'hostname slots=N'")
    ap.add_argument("--hosts-bandwidth", type=rate_arg, default=None, metavar="RATE",
                    help="with --hosts/--hostfile: the rate of the links between your hosts "
                         "(e.g. 10gbit), written in the rows' link_bandwidth column for the cost model")
    ap.add_argument("--strategy", choices=("horovod", "mwms"), default="horovod",
                    help="mwms: also run TensorFlow's MultiWorkerMirroredStrategy (no Horovod, "
                         "uncompressed) as a baseline row per worker count and bandwidth "
                         "(--example digits or digits-wide; always the TensorFlow example, "
                         "compared with the Horovod runs of --framework, torch too)")
    ap.add_argument("--target-accuracy", type=float, default=None, metavar="A",
                    help="test accuracy in (0, 1] to time: adds time and epochs to it per run and the "
                         "fastest method to it per setting (examples with accuracy: digits, "
                         "digits-wide, cifar10)")
    ap.add_argument("--target-loss", type=float, default=None, metavar="L",
                    help="--example lm: validation loss (nats a byte) to time: adds time and steps "
                         "to it per run and the fastest method to it per setting")
    ap.add_argument("--stop-at-target", action="store_true",
                    help="with --target-accuracy (--target-loss): every run stops after the first "
                         "epoch (evaluation) that reaches it (the examples' --stop-at), so the "
                         "curves end there and a time-to-target matrix takes less time; runs that "
                         "never reach it train to the end")
    ap.add_argument("--out", required=True, metavar="DIR", help="folder for results and plots")
    ap.add_argument("--resume", action="store_true",
                    help="keep the successful runs already in DIR/results.csv; run the rest")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run the whole matrix N times, each time after the last; results.csv "
                         "keeps every run, and the tables, plots and --predict take each "
                         "setting's median, column by column (default 1)")
    ap.add_argument("--predict", action="store_true",
                    help="fit the cost model and write DIR/prediction.md")
    ap.add_argument("--alpha-us", type=float, default=None, metavar="US",
                    help="with --predict: latency per message step in microseconds (default: "
                         f"fitted from runs at two or more worker counts, else {DEFAULT_ALPHA_US:g})")
    ap.add_argument("--per-node", type=runtools.positive_int, default=DEFAULT_PER_NODE, metavar="L",
                    help="with --predict: workers per node in the table for clusters of nodes "
                         f"(default {DEFAULT_PER_NODE})")
    ap.add_argument("--local-bandwidth", type=rate_arg, default=netcap.format_rate(DEFAULT_LOCAL_BPS),
                    metavar="RATE",
                    help="with --predict: the links inside a node in that table (default "
                         f"{netcap.format_rate(DEFAULT_LOCAL_BPS)})")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds before one run is stopped and recorded as timed out (default 900)")
    ap.add_argument("--quiet", action="store_true", help="no progress display")
    return ap


def _check_hosts(ap, args) -> None:
    """--hosts/--hostfile: parsed into ``args.host_list`` (None without them), and what
    they cannot run with refused before anything runs."""
    args.host_list = None
    if args.bandwidth is DEFAULT_BANDWIDTHS:  # (not given)
        args.bandwidth = [UNCAPPED] if args.hosts or args.hostfile else list(DEFAULT_BANDWIDTHS)
    if not (args.hosts or args.hostfile):
        if args.hosts_bandwidth:
            ap.error("--hosts-bandwidth is the rate between the hosts of --hosts or --hostfile")
        return
    flag = "--hosts" if args.hosts else "--hostfile"
    try:
        args.host_list = real_hosts.parse(args.hosts or real_hosts.read_hostfile(args.hostfile))
    except ValueError as exc:
        ap.error(str(exc))
    if args.bandwidth != [UNCAPPED] or args.latency:
        ap.error(f"{flag} runs on your hosts' own network, uncapped: --bandwidth takes only "
                 f"'{UNCAPPED}' and --latency none with it (capped links are simulated on one "
                 "machine, without --hosts)")
    if args.nodes > 1:
        ap.error(f"{flag} runs on real nodes: --nodes (simulated nodes on one machine) goes without it")
    if args.strategy == "mwms":
        ap.error(f"--strategy mwms runs on this machine only, without {flag}")
    total = real_hosts.slots(args.host_list)
    big = [n for n in args.np if n > total]
    if big:
        ap.error(f"--np {' '.join(map(str, big))} does not fit the {total} slots of "
                 f"{real_hosts.text_of(args.host_list)}")
    for n in args.np:
        used = real_hosts.layout(args.host_list, n)
        if len({w for _, w in used}) > 1:
            print(f"compare: np {n} fills the hosts unevenly ({real_hosts.text_of(used)}); the cost "
                  "model takes nodes of np/nodes workers", file=sys.stderr, flush=True)
    first = args.host_list[0][0]
    if not real_hosts.is_local(first):
        print(f"compare: rank 0 runs on {first}, which writes each run's summary into {args.out}: "
              "that folder must be the same on both machines (or list this machine first)",
              file=sys.stderr, flush=True)


def _check_device(ap, args) -> None:
    """``--device`` resolved once for the whole matrix (``args.device``: cuda or cpu), as
    the examples would resolve it here -- asking the frameworks the runs use (TensorFlow's
    too under ``--strategy mwms``) -- and ``cuda`` refused where one sees no GPU, before
    anything runs.  On hosts that do not include this machine there is nothing here to
    ask: the default is then cpu and cuda is left to the examples there."""
    if args.example_args and "--device" in args.example_args.split():
        ap.error("--example-args has --device: give compare's --device (every run takes it)")
    if args.host_list and not any(real_hosts.is_local(h) for h, _ in args.host_list):
        args.device = args.device or "cpu"
        return
    frameworks = {args.framework} | ({"tensorflow"} if args.strategy == "mwms" else set())
    try:
        args.device = devices.resolve(args.device, sorted(frameworks))
    except ValueError as exc:
        ap.error(str(exc))


def _check_language_model(ap, args) -> None:
    """What only the language model (``--example lm``, PyTorch's) runs -- optimizers,
    DiLoCo, a target loss -- refused elsewhere, and what it lacks (a test accuracy)."""
    lm = args.example in LOSS_EXAMPLES
    if args.example in TORCH_ONLY and args.framework != "torch":
        ap.error(f"--example {args.example} is PyTorch's only: --framework torch")
    if args.optimizer and args.example not in OPTIMIZERS:
        ap.error("--optimizer chooses the optimizers of --example " + " or ".join(OPTIMIZERS))
    if args.diloco and args.example not in OPTIMIZERS:
        ap.error("--diloco runs with --example " + " or ".join(OPTIMIZERS))
    if args.fragments > 1 and not args.diloco:
        ap.error("--fragments needs --diloco H")
    if args.diloco and args.optimizer and OPTIMIZERS[args.example][0] not in args.optimizer:
        ap.error(f"--diloco runs {OPTIMIZERS[args.example][0]} inside: add it to --optimizer")
    if args.target_loss is not None:
        if not lm:
            ap.error("--target-loss needs an example that reports a validation loss (--example "
                     + " or ".join(LOSS_EXAMPLES) + ")")
        if not (math.isfinite(args.target_loss) and args.target_loss > 0):
            ap.error(f"--target-loss is a validation loss > 0 (nats a byte), got {args.target_loss:g}")
    if lm and args.target_accuracy is not None:
        ap.error(f"--example {args.example} reports a validation loss, not a test accuracy: "
                 "--target-loss L")


def target_of(args) -> tuple:
    """(target, metric): the matrix's --target-loss (LOSS) or --target-accuracy (ACCURACY)."""
    if getattr(args, "target_loss", None) is not None:
        return args.target_loss, LOSS
    return args.target_accuracy, ACCURACY


def on_hosts(run, host_list, link_bandwidth=None):
    """``run`` on real hosts: the hosts its ranks fill (``hosts``, as horovodrun places
    them) and their number (``nodes``), and the stated rate between them."""
    run = run.copy()
    used = real_hosts.layout(host_list, int(run["np"]))
    run["hosts"], run["nodes"] = real_hosts.text_of(used), len(used)
    if link_bandwidth and len(used) > 1:
        run["link_bandwidth"] = link_bandwidth
    return run


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:  # (--bandwidth's rates are labels already: bandwidth_arg)
        if args.latency:
            netcap.parse_latency(args.latency)
        netcap.parse_rate(args.local_bandwidth)
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeat < 1:
        ap.error(f"--repeat must be 1 or more, got {args.repeat}")
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
    _check_language_model(ap, args)
    if args.stop_at_target and args.target_accuracy is None and args.target_loss is None:
        ap.error("--stop-at-target needs --target-accuracy A")
    if args.modes_for:
        if not (args.local_sgd or args.delay or args.diloco):
            ap.error("--modes-for needs --local-sgd or --delay")
        stray = [s for s in args.modes_for if s not in args.compression]
        if stray:
            ap.error(f"--modes-for names specs that --compression does not: {' '.join(stray)}")
    _check_hosts(ap, args)
    if args.nodes > 1 and any(n > 1 and n % args.nodes for n in args.np):
        ap.error(f"--np counts above 1 must be multiples of --nodes {args.nodes}")
    hier = [e for e in args.exchange or () if e.startswith("hierarchical")]
    if hier and args.nodes < 2:
        ap.error(f"--exchange {' '.join(hier)} needs --nodes 2 or more (simulated nodes)")
    if args.nodes > 1 and args.strategy == "mwms":
        ap.error("--strategy mwms runs without --nodes")
    if args.strategy == "mwms" and args.example not in MWMS_EXAMPLES:
        ap.error("--strategy mwms runs with --example " + " or ".join(MWMS_EXAMPLES))
    try:
        check_modes(args.modes_for or args.compression,
                    run_modes(args.local_sgd, args.delay, args.strategy, args.diloco, args.fragments))
    except ValueError as exc:
        ap.error(str(exc))
    _check_device(ap, args)  # (last: it imports the frameworks)
    try:
        for framework in {args.framework} | ({"tensorflow"} if args.strategy == "mwms" else set()):
            examples_dir(framework)
    except FileNotFoundError as exc:
        ap.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(GLOO_TIMEOUT_ENV, str(GLOO_TIMEOUT_S))  # (every run inherits it)
    with stopping.stop_signals():  # from here on, a stop signal ends the whole matrix
        before = set(stopping.children(os.getpid()))  # (not ours to kill or reap)
        state = {"done": 0, "total": 0, "rows": None, "before": before}
        reaper = stopping.become_subreaper()  # orphans of our launches come back to us
        try:
            return _matrix(args, out, state, reaper)
        except stopping.Stopped as stop:
            return _stopped(stop, out, state, before)
        finally:
            if reaper:
                stopping.become_subreaper(False)


def _stopped(stop: stopping.Stopped, out: Path, state: dict, before: set) -> int:
    """A stop signal: kill every process the matrix started (whatever session each is
    in), remove its namespaces, keep the rows done; the exit status says which signal."""
    killed = stopping.kill_tree([os.getpid()], include_roots=False, spare=before)
    stopping.reap(killed)
    if netcap.available()[0]:
        netcap.remove_mine()
    if state["rows"] is not None:  # (written after each run; once more, whole)
        write_csv(out / "results.csv", state["rows"])
    print(f"compare: stopped by {stop.name} after {state['done']} of {state['total']} runs; "
          f"results so far in {out}; --resume continues", file=sys.stderr, flush=True)
    return stop.exit_status


def _matrix(args, out: Path, state: dict, reaper: bool) -> int:
    """Run the matrix's runs not done yet, then write the results (and the prediction)."""
    capped_ok, why = netcap.available()
    if any(b != UNCAPPED for b in args.bandwidth) and not capped_ok:
        print(f"compare: {why}; running uncapped only", file=sys.stderr, flush=True)
    if 1 in args.np and any(b != UNCAPPED for b in args.bandwidth):
        print("compare: np 1 runs once, uncapped (a single worker sends nothing)", flush=True)
    runs = plan_runs(args, capped_ok)
    if args.host_list:
        runs = [on_hosts(r, args.host_list, args.hosts_bandwidth) for r in runs]
    csv_path = out / "results.csv"
    rows = read_csv(csv_path) if args.resume else []
    for r in rows:
        r["mode"] = mode_of(r)  # results from before modes: sync
    done = {run_key(r) for r in rows if r.get("status") == "ok"}
    rows = [r for r in rows if r.get("status") == "ok"]
    todo = [r for r in runs if run_key(r) not in done]
    state.update(done=len(runs) - len(todo), total=len(runs))
    if args.resume:
        print(f"compare: resuming; {len(runs) - len(todo)} of {len(runs)} runs already done", flush=True)
        elsewhere = sorted({device_of(r) for r in rows} - {args.device or "cpu"})
        if elsewhere:
            print(f"compare: results.csv holds runs on {', '.join(elsewhere)}, kept beside these "
                  f"in the tables; this matrix, its plots and prediction are on {args.device} "
                  f"(--device {elsewhere[0]} resumes those)", flush=True)
    progress = runtools.Progress(len(todo), "runs", enabled=not args.quiet, stream=sys.stdout)
    progress.update(0)
    failed = 0
    target, metric = target_of(args)
    for i, run in enumerate(todo):
        row = add_targets([execute(args, run, out)], target, metric)[0]
        if reaper:
            stopping.reap(spare=state["before"])  # orphans that ended during the run
        rows.append(row)
        state.update(done=state["done"] + 1, rows=rows)
        write_csv(csv_path, rows)
        if row["status"] != "ok":
            failed += 1
        note = f"{method(run)} np {run['np']} {run['bandwidth']}: " + (
            f"{float(row['images_per_sec']):.1f} img/s" if row["status"] == "ok" else row["status"])
        progress.update(i + 1, note)
    order = {run_key(r): i for i, r in enumerate(runs)}
    rows.sort(key=lambda r: order.get(run_key(r), len(order)))
    add_targets(rows, target, metric)
    write_csv(csv_path, rows)
    shown, note = _shown(rows, args.repeat)
    write_markdown(out / "results.md", shown, target, args.stop_at_target, metric, note)
    here = [r for r in shown if device_of(r) == (args.device or "cpu")]  # (not another device's)
    files = [str(csv_path), str(out / "results.md")] + plot(out, here, target, metric)
    print((out / "results.md").read_text(), flush=True)
    if args.predict:
        text, say = predict(here, args.alpha_us, args.target_accuracy, args.per_node,
                            netcap.parse_rate(args.local_bandwidth))
        (out / "prediction.md").write_text(text)
        files.append(str(out / "prediction.md"))
        for line in say:
            print(line, flush=True)
    print("wrote: " + ", ".join(files), flush=True)
    if failed:
        print(f"compare: {failed} run(s) failed; see the status column and their logs", flush=True)
    return 1 if failed == len(todo) and todo else 0

def _shown(rows: list, repeat: int) -> tuple[list, str]:
    """The rows the tables, plots and prediction take, and what results.md says of them:
    with repetitions (``--repeat``, or a resumed folder that holds them), each setting's
    medians (:func:`.repeats.medians`)."""
    repeat = max([repeat] + [repeat_of(r) for r in rows])
    if repeat < 2:
        return rows, ""
    shown = medians(rows)
    fewer = sorted({f"{method(r)} np {r['np']} {r['bandwidth']}" for r in shown
                    if r.get("status") == "ok" and int(r.get("repeats", 1)) < repeat})
    note = (f"Each row is the median of its setting's successful runs, column by column "
            f"(`--repeat {repeat}`; every run is a row of results.csv).")
    if fewer:
        note += " Fewer than " + str(repeat) + " succeeded for: " + "; ".join(fewer) + "."
    return shown, note


if __name__ == "__main__":
    sys.exit(main())
