"""What the PyTorch and TensorFlow example scripts share: flags, progress, the summary.

Every example takes the same core flags (``--compression``,
``--backward-passes-per-step``, ``--epochs``/``--steps``, ``--device``, ``--seed``,
``--json PATH``), shows progress on rank 0, and writes a summary with at least
the keys of :data:`SUMMARY_KEYS`: stable names that hvd-compress-compare and
users' scripts read (more keys may come; these keep their names).
Framework-neutral: no torch or tensorflow here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from ..core.registry import core_of
from ..localsteps import LocalSGDSchedule, check_local_args
from .devices import add_device_arg
from .workers import usable_cores

SUMMARY_KEYS = ("framework", "example", "compression", "np", "steps", "images_per_sec",
                "images_per_sec_per_worker", "bytes_per_step", "compute_ms", "encode_ms",
                "comm_ms", "decode_ms", "test_accuracy", "wall_s")
#: The summary key of the examples that evaluate after every epoch (digits, CIFAR-10): a list
#: of points with these keys, one per epoch, in order.  ``seconds``: training time from the
#: start of the first epoch to the end of this one, evaluation excluded (the clock of
#: ``images_per_sec``), so a curve's last point is the run's training time and accuracy.
CURVE = "curve"
CURVE_KEYS = ("epoch", "seconds", "test_accuracy")


def worker_threads(local_size: int) -> int:
    """Compute threads for one worker: ``HVD_COMPRESS_THREADS`` when set (the capped-link
    launcher sets it: its workers share one machine but each is alone on its "host"),
    else the cores this process may use (:func:`usable_cores`) shared among the workers on it."""
    env = os.environ.get("HVD_COMPRESS_THREADS")
    if env:
        return max(1, int(env))
    return max(1, usable_cores() // max(1, local_size))


def limit_kernel_threads(n: int) -> None:
    """The fused numba kernels' thread pool to ``n`` threads: workers sharing a machine
    must not each spin up a thread per core (oversubscribed, they run several times slower)."""
    from .. import kernels
    if kernels.AVAILABLE:
        import numba
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def print_plan(rows, args, rank: int) -> None:
    """Rank 0 prints the per-tensor plan at start (not with --quiet)."""
    if rank == 0 and not args.quiet:
        from ..pertensor import format_plan
        print(format_plan(rows, args.start_step), flush=True)


def owns_momentum(comp) -> bool:
    """Whether one of ``comp``'s compressors keeps the momentum itself (DGC's momentum
    correction): the wrapped optimizer then runs without one."""
    return any(core_of(s).owns_momentum for s in comp.specs())


uses_dgc = owns_momentum  # the name the examples import


def past_warmup(comp) -> None:
    """Put a compressor with a warm-up schedule (DGC) at its final sparsity: the synthetic
    benchmarks time the steady state, which a few steps of a fresh run never reach."""
    epochs = [int(p.params.get("warmup_epochs", 0)) for s in comp.specs() for p in s.parts]
    if max(epochs, default=0) > 0:
        comp.set_epoch(max(epochs))


def spec_arg(text: str) -> str:
    """A spec, or the per-tensor mapping form ``pattern=spec;pattern=spec``."""
    from ..core import policy
    try:
        policy.Policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def check_accuracy(value: float, flag: str) -> float:
    """``value`` if it is a test accuracy in (0, 1], else ValueError naming ``flag``."""
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{flag} is a test accuracy in (0, 1], e.g. 0.95; got {value:g}")
    return value


def accuracy_arg(text: str) -> float:
    """``--stop-at``'s type: a test accuracy in (0, 1]."""
    try:
        return check_accuracy(float(text), "--stop-at")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class _ExampleParser(argparse.ArgumentParser):
    """Rejects flag combinations local SGD / DGA cannot run, as a usage error."""

    def parse_args(self, args=None, namespace=None):
        from ..core import policy
        ns = super().parse_args(args, namespace)
        try:  # every spec the --compression value names (a mapping: each of its rules')
            for spec in policy.Policy(ns.compression).known_specs() or [None]:
                check_local_args(ns.local_sgd, ns.backward_passes_per_step, ns.local_sgd_warmup_steps,
                                 ns.delay, True, spec)
        except ValueError as exc:
            self.error(str(exc).replace("local_sgd_warmup_steps", "--local-sgd-warmup-steps")
                       .replace("local_sgd", "--local-sgd").replace("delay", "--delay"))
        return ns


def passes_per_step(args) -> int:
    """Backward passes per optimizer step: one under local SGD (each pass is a local step)."""
    return 1 if args.local_sgd else args.backward_passes_per_step


def local_schedule(args) -> LocalSGDSchedule | None:
    """The examples' local SGD schedule (None without --local-sgd)."""
    if not args.local_sgd:
        return None
    return LocalSGDSchedule(args.backward_passes_per_step, args.local_sgd_warmup_steps)


def needs_final_average(args, steps: int) -> bool:
    """Whether, under --local-sgd, the workers still differ after ``steps`` optimizer steps
    (the examples then average once more, to evaluate the mean model)."""
    schedule = local_schedule(args)
    if schedule is None or steps == 0:
        return False
    return not (schedule.synchronous(steps - 1) or schedule.averages_after(steps - 1))


#: ``--hierarchical`` as the wrappers' ``hierarchical=`` takes it
HIERARCHICAL = {"auto": None, "on": True, "off": False}
#: ``--exchange``: what the wrappers' ``exchange=`` takes (:mod:`hvd_compress.session`)
EXCHANGES = ("auto", "allgather", "allreduce", "two-phase", "hierarchical",
             "hierarchical+two-phase")


def _session_of(wrapper):
    """A wrapper's :class:`~hvd_compress.session.Session` (None: Horovod's own)."""
    return getattr(wrapper, "_session", None) or getattr(wrapper, "_hvdc_session", None)


def exchange_used(wrapper) -> str:
    """What a wrapper's exchange was, for a run's summary: the one asked for, or ``auto``'s
    choices counted (``"auto: allgather 3, two-phase 2"``); "" for Horovod's own."""
    s = _session_of(wrapper)
    if s is None:
        return ""
    if s.auto is None:
        return s.exchange_mode
    counts: dict = {}
    for exchange, _ in s.auto.plan().values():
        counts[exchange] = counts.get(exchange, 0) + 1
    return "auto: " + ", ".join(f"{e} {n}" for e, n in sorted(counts.items()))


def exchange_why(wrapper) -> dict:
    """``exchange="auto"``'s evidence, for a run's summary: the links and codec rates it
    measured and, per tensor, the exchange and its priced alternatives ({} otherwise)."""
    s = _session_of(wrapper)
    if s is None or s.auto is None or s.auto.links is None:
        return {}
    links = s.auto.links
    return {"links": {k: getattr(links, k) for k in ("alpha_s", "s_per_byte", "local_alpha_s",
                                                     "local_s_per_byte")},
            "codec_s": {spec: dict(zip(("encode_per_value", "decode_per_value",
                                         "encode_per_call", "decode_per_call"), r))
                        for spec, r in s.auto.rates.items()},
            "probe_values": s.auto.probe_values,
            "tensors": {name: why for name, (_, why) in s.auto.plan().items()}}


def local_fields(args) -> dict:
    """Summary keys saying how often workers talk (local SGD period, DGA delay)."""
    return {"backward_passes_per_step": args.backward_passes_per_step,
            "local_sgd": bool(args.local_sgd), "delay": args.delay}


def common_parser(description: str, epochs: int | None = None, steps: int | None = None,
                  batch_size: int = 32, lr: float = 0.05) -> argparse.ArgumentParser:
    ap = _ExampleParser(description=description)
    ap.add_argument("--compression", type=spec_arg, default="none", metavar="SPEC",
                    help="compressor spec, e.g. none, fp16, topk:ratio=0.01, dgc:ratio=0.001, "
                         "onebit, 'topk:ratio=0.01+qsgd:levels=16', or per tensor "
                         "'pattern=spec;pattern=spec' (first match wins, e.g. "
                         "'*fc*=topk:ratio=0.01;*=fp16') (default: none)")
    ap.add_argument("--min-numel", type=nonnegative_int, default=1024, metavar="N",
                    help="tensors with fewer elements travel uncompressed "
                         "(default 1024; 0: compress every tensor)")
    ap.add_argument("--start-step", type=nonnegative_int, default=0, metavar="N",
                    help="send uncompressed for the first N optimizer steps (default 0)")
    ap.add_argument("--hierarchical", choices=sorted(HIERARCHICAL), default="auto",
                    help="compressed gradients summed dense inside each node and compressed only "
                         "between nodes: auto (wherever the workers span two or more nodes of "
                         "two or more), on (required), off (default: auto)")
    ap.add_argument("--exchange", choices=EXCHANGES, default="auto",
                    help="how compressed payloads travel: auto (the cheapest for the links the "
                         "workers measure at the first step), allgather, two-phase (bytes per "
                         "worker constant in the workers), hierarchical, hierarchical+two-phase "
                         "(node process sets needed), allreduce (summable payloads only) "
                         "(default: auto)")
    ap.add_argument("--backward-passes-per-step", type=positive_int, default=1, metavar="N",
                    help="accumulate N backward passes locally before one exchange (default 1); "
                         "with --local-sgd: average the parameters every N local steps")
    ap.add_argument("--local-sgd", action="store_true",
                    help="local SGD: every worker steps on its own gradients, the parameters are "
                         "averaged every --backward-passes-per-step steps")
    ap.add_argument("--local-sgd-warmup-steps", type=nonnegative_int, default=0, metavar="K",
                    help="with --local-sgd: K ordinary synchronous steps first (post-local SGD)")
    ap.add_argument("--delay", type=nonnegative_int, default=0, metavar="D",
                    help="Delayed Gradient Averaging: apply step i's average at step i+D "
                         "(default 0: synchronous)")
    add_device_arg(ap)
    if epochs is not None:
        ap.add_argument("--epochs", type=positive_int, default=epochs, help="epochs (default %(default)s)")
        ap.add_argument("--stop-at", type=accuracy_arg, default=None, metavar="A",
                        help="stop after the first epoch whose test accuracy (rank 0's) is at "
                             "least A, in (0, 1]: a time-to-accuracy run need not train on "
                             "(default: run every epoch)")
    if steps is not None:
        ap.add_argument("--steps", type=positive_int, default=steps,
                        help="optimizer steps to time (default %(default)s)")
    ap.add_argument("--batch-size", type=positive_int, default=batch_size,
                    help="per-worker batch size (default %(default)s)")
    ap.add_argument("--lr", type=float, default=lr, help="learning rate (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--json", metavar="PATH", help="write the run summary (JSON) to PATH on rank 0")
    ap.add_argument("--quiet", action="store_true", help="no progress display")
    return ap


def script_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a script that launches example runs and tabulates them (its usage
    from ``doc``), with the flags they share: ``--out``, ``--np``, ``--epochs``,
    ``--timeout``, ``--quiet`` (add the script's own, then ``parse_args``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc.split("\n\n", 1)[1])
    ap.add_argument("--out", required=True, metavar="DIR", help="folder for the table and logs")
    ap.add_argument("--np", type=positive_int, default=2, help="workers (default 2)")
    ap.add_argument("--epochs", type=positive_int, default=15, help="default 15")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    ap.add_argument("--quiet", action="store_true", help="no progress display")
    return ap


def add_synthetic_args(ap: argparse.ArgumentParser) -> None:
    """The synthetic benchmarks' own flags (both frameworks; Horovod's benchmark shape)."""
    ap.add_argument("--num-warmup-batches", type=int, default=3, help="untimed steps (default 3)")
    ap.add_argument("--num-batches-per-iter", type=positive_int, default=5,
                    help="steps per timed iteration (default 5)")
    ap.add_argument("--num-iters", type=positive_int, default=5, help="timed iterations (default 5)")
    ap.add_argument("--width", type=positive_int, default=16, help="first stage width (default 16)")
    ap.add_argument("--blocks", type=positive_int, nargs="+", default=[1, 1, 1],
                    help="residual blocks per stage (default 1 1 1)")
    ap.add_argument("--image-size", type=positive_int, default=32, help="default 32")
    ap.add_argument("--num-classes", type=positive_int, default=10, help="default 10")
    ap.add_argument("--momentum", type=float, default=0.0,
                    help="SGD momentum (default 0: plain SGD, as Horovod's benchmark)")


def add_cifar_args(ap: argparse.ArgumentParser) -> None:
    """The CIFAR-10 examples' own flags (both frameworks)."""
    ap.add_argument("--data-dir", required=True, help="folder with the CIFAR-10 python batches")
    ap.add_argument("--width", type=positive_int, default=16, help="first stage width (default 16)")
    ap.add_argument("--blocks", type=positive_int, nargs="+", default=[1, 1, 1],
                    help="residual blocks per stage (default 1 1 1)")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    ap.add_argument("--limit-train", type=int, default=0,
                    help="use only the first N training images (0: all)")


def launch_seeds(runs: list[dict], label: str, one, quiet: bool, out, columns) -> list[dict]:
    """Scripts that launch one digits run per (framework, compression, seed): ``one(run)``
    returns each run's row (``status``, ``test_accuracy``...), with progress shown; the
    rows are written to ``out/<label>.csv`` with ``columns`` and returned."""
    import csv
    progress = Progress(len(runs), label, enabled=not quiet)
    rows = []
    for i, run in enumerate(runs):
        rows.append(one(run))
        acc = rows[-1]["test_accuracy"]
        progress.update(i + 1, f"{run['framework']} {run['compression']} seed {run['seed']}: "
                        f"{rows[-1]['status'] if acc is None else f'{100 * float(acc):.1f}%'}")
    with open(out / f"{label}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return rows


class Progress:
    """A one-line progress display on rank 0 (plain lines when not a terminal)."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None):
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.tty = self.stream.isatty()
        self.last = -1.0

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty or done == self.total or now - self.last >= 5.0:
            self.last = now
            pct = 100.0 * done / max(1, self.total)
            bar = "#" * int(pct / 5)
            line = f"{self.label} [{bar:<20s}] {done}/{self.total} {pct:5.1f}% " \
                   f"{now - self.t0:6.1f}s {note}"
            self.stream.write(("\r" + line) if self.tty else line + "\n")
            if self.tty and done == self.total:
                self.stream.write("\n")
            self.stream.flush()


#: the step's time split: each None (JSON null) in a summary where it was not measured
SPLIT_KEYS = ("encode_ms", "comm_ms", "decode_ms")


def summary(framework: str, example: str, compression: str, np_: int, steps: int,
            images: int, train_s: float, stats: dict, test_accuracy, wall_s: float,
            strategy: str = "horovod", **extra) -> dict:
    """The run summary; ``stats`` holds summed bytes_sent/encode_ms/comm_ms/decode_ms
    over the ``steps`` steps -- a split it lacks (or holds as None) was not measured and
    is null, never 0 (``compute_ms`` is then the step time less the split measured);
    ``strategy``: what exchanged the gradients (Horovod, or TensorFlow's ``mwms``)."""
    steps = max(1, steps)
    per_step = {k: None if stats.get(k) is None else stats[k] / steps for k in SPLIT_KEYS}
    step_ms = 1e3 * train_s / steps
    compute = max(0.0, step_ms - sum(v for v in per_step.values() if v is not None))
    ips = images / train_s if train_s > 0 else 0.0
    out = {
        "framework": framework, "example": example, "compression": compression, "np": np_,
        "steps": steps, "images_per_sec": round(ips, 2),
        "images_per_sec_per_worker": round(ips / max(1, np_), 2),
        "bytes_per_step": int(round(stats.get("bytes_sent", 0) / steps)),
        "compute_ms": round(compute, 3), "step_ms": round(step_ms, 3),
        **{k: None if v is None else round(v, 3) for k, v in per_step.items()},
        "local_bytes_per_step": int(round(stats.get("local_bytes", 0) / steps)),
        # bytes in and out over a worker's links (the account's, by collective)
        "wire_in_per_step": int(round(stats.get("wire_in", 0) / steps)),
        "wire_out_per_step": int(round(stats.get("wire_out", 0) / steps)),
        "test_accuracy": None if test_accuracy is None else round(float(test_accuracy), 4),
        "wall_s": round(wall_s, 3), "strategy": strategy,
    }
    if stats.get("collectives"):
        out["collectives_per_step"] = round(stats["collectives"] / steps, 3)
    for key in ("encode_calls", "decode_calls", "tensors"):  # (the cost model scales by them)
        if stats.get(key):
            out[f"{key}_per_step"] = round(stats[key] / steps, 3)
    out.update(extra)
    return out


def stop_agreed(args, accuracy: float, from_rank0) -> bool:
    """``--stop-at``: whether every worker ends training after an epoch that scored
    ``accuracy`` on this one.  Rank 0's answer decides (under local SGD the replicas score
    differently): ``from_rank0(answer)`` returns rank 0's answer on every worker (a
    broadcast, a strategy's vote).  False without the flag, with no collective."""
    if getattr(args, "stop_at", None) is None:
        return False
    return bool(from_rank0(accuracy >= args.stop_at))


def curve_point(epoch: int, seconds: float, test_accuracy: float) -> dict:
    """One point of the accuracy curve (:data:`CURVE`), rounded as the summary rounds."""
    return {"epoch": int(epoch), "seconds": round(float(seconds), 3),
            "test_accuracy": round(float(test_accuracy), 4)}


def write_summary(path: str | None, doc: dict) -> None:
    """Print the summary and, with a path, write it as JSON."""
    line = ", ".join(f"{k}={doc[k]}" for k in SUMMARY_KEYS if k in doc)
    print(f"summary: {line}", flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
