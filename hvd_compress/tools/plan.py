"""What a comparison runs: the matrix of compressor x mode x worker count x bandwidth.

A run is a :class:`~hvd_compress.tools.runrow.RunRow` holding :data:`RUN_KEYS` (its CSV
row adds the other :data:`COLUMNS`); the modes
say how often the workers talk (``sync``, local SGD, DiLoCo, DGA, TensorFlow's
MultiWorkerMirroredStrategy, the flat exchange beside the hierarchical one); the language
model's runs also say which optimizer trained (AdamW, 1-bit Adam, 0/1 Adam); every run of a
matrix trains on one device (``cuda`` or ``cpu``: :mod:`.devices`), which its key holds.
:func:`plan_runs` turns ``hvd-compress-compare``'s arguments into the runs, which
:mod:`.run` launches, :mod:`.report` tabulates and :mod:`.predict` fits.
"""

from __future__ import annotations

import re

from . import netcap, runrow
from .runrow import RunRow

EXAMPLES = {"synthetic": "synthetic_benchmark.py", "digits": "train_digits.py",
            "digits-wide": "train_digits.py", "cifar10": "train_cifar10.py", "lm": "train_lm.py"}
FRAMEWORK_DIRS = {"torch": "torch_examples", "tensorflow": "tf_examples"}
#: examples one framework lacks: the language model is PyTorch's only
TORCH_ONLY = ("lm",)
#: examples whose runs report a validation loss (``--target-loss``), not a test accuracy
LOSS_EXAMPLES = ("lm",)
#: examples with a choice of optimizer (``--optimizer``): AdamW, the first, trains with
#: every compressor and mode; each other one is its own method, a row per setting
#: compressing its own messages (:data:`ADAM_COMPRESSION`, by the two-phase exchange)
OPTIMIZERS = {"lm": ("adamw", "onebit-adam", "zeroone-adam")}
#: the compressor 1-bit Adam and 0/1 Adam send their momentum with (DeepSpeed's: a sign and
#: one scale, error feedback on both sides of the two-phase exchange)
ADAM_COMPRESSION = "efsignsgd"
ADAM_EXCHANGE = "two-phase"
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
    "lm": "--steps 600 --eval-every 50",
}
RUN_KEYS = ("framework", "example", "compression", "np", "bandwidth", "latency", "mode", "nodes",
            "device", "optimizer", "repeat")
#: results.csv's columns (:class:`~hvd_compress.tools.runrow.RunRow`'s fields): the examples'
#: summary keys, then what compare adds (new ones are appended, so that the older columns
#: keep their places)
COLUMNS = runrow.COLUMNS
UNCAPPED = "uncapped"
SYNC = "sync"
#: the baseline without Horovod: TensorFlow's MultiWorkerMirroredStrategy (``--strategy
#: mwms``; uncompressed, launched by :mod:`.mwms`, in the namespaces when capped)
MWMS = "TF MWMS"
#: with ``--nodes``: compressed tensors by every worker's allgather (or integer sum), not
#: the hierarchical exchange (``--exchange allgather``; the mode sync beside it runs
#: ``--exchange hierarchical``)
FLAT = "flat"
MWMS_EXAMPLES = ("digits", "digits-wide")
#: ``--exchange``: modes that run the compressed tensors by one exchange
#: (:func:`hvd_compress.session.resolve_exchange`); the hierarchical ones need ``--nodes``
EXCHANGE_MODES = ("allgather", "two-phase", "hierarchical", "hierarchical+two-phase", "auto")


def local_sgd_mode(period: int) -> str:
    return f"local SGD H={int(period)}"


def diloco_mode(period: int, fragments: int = 1) -> str:
    """DiLoCo's mode: an outer step every ``period`` steps, the parameters in ``fragments``
    (Streaming DiLoCo) when more than one."""
    return f"DiLoCo H={int(period)}" + (f" F={int(fragments)}" if int(fragments) > 1 else "")


def dga_mode(delay: int) -> str:
    return SYNC if int(delay) == 0 else f"DGA D={int(delay)}"


def run_modes(periods=(), delays=(), strategy: str = "horovod", diloco=(),
              fragments: int = 1) -> list[str]:
    """The modes of a matrix: sync first (the baseline), then DGA delays, then local SGD
    periods (``--delay 0`` is sync itself), then DiLoCo periods (each with ``fragments``),
    then TensorFlow's strategy with ``strategy="mwms"``."""
    modes = [SYNC] + [dga_mode(d) for d in delays or ()] + [local_sgd_mode(h) for h in periods or ()]
    modes += [diloco_mode(h, fragments) for h in diloco or ()]
    modes += [MWMS] if strategy == "mwms" else []
    return list(dict.fromkeys(modes))


def mode_of(row: dict) -> str:
    """A row's mode (rows of results written before modes existed are sync)."""
    return row.get("mode") or SYNC


def mode_flags(mode: str, nodes: int = 1, np_: int = 0) -> list[str]:
    """The example flags a mode needs (``nodes``: the run's simulated nodes, where sync is
    the hierarchical exchange -- with two or more workers a node, ``np_`` workers in all:
    else it cannot run and sync is the default -- and flat the allgather)."""
    if mode in ("", SYNC):
        return ["--exchange", "hierarchical"] if nodes > 1 and np_ >= 2 * nodes else []
    if mode == MWMS:
        return ["--strategy", "mwms"]
    if mode == FLAT:
        return ["--exchange", "allgather"]
    if mode in EXCHANGE_MODES:
        return ["--exchange", mode]
    m = re.fullmatch(r"local SGD H=(\d+)", mode)
    if m:
        return ["--local-sgd", "--backward-passes-per-step", m.group(1)]
    m = re.fullmatch(r"DGA D=(\d+)", mode)
    if m:
        return ["--delay", m.group(1)]
    m = re.fullmatch(r"DiLoCo H=(\d+)(?: F=(\d+))?", mode)
    if m:
        return ["--diloco", m.group(1)] + (["--fragments", m.group(2)] if m.group(2) else [])
    raise ValueError(f"unknown mode {mode!r} (sync, 'local SGD H=<period>', 'DiLoCo H=<period>', "
                     f"'DGA D=<delay>' or {MWMS!r})")


def check_modes(specs, modes) -> None:
    """Raise ValueError for a compressor that a mode cannot run (the optimizers' own rule,
    e.g. DGA needs a one-round compressor), before anything is launched."""
    from ..localsteps import check_local_args, check_outer_args
    for mode in modes:  # DiLoCo's period: a multiple of its fragments
        flags = mode_flags(mode) if mode not in (MWMS, FLAT) and mode not in EXCHANGE_MODES else []
        if "--diloco" in flags:
            fragments = int(flags[-1]) if "--fragments" in flags else 1
            try:
                check_outer_args(True, 0.7, 0.9, fragments, int(flags[1]))
            except ValueError as exc:
                raise ValueError(f"mode {mode}: {exc}") from None
    for spec in specs:
        for mode in modes:
            if mode in (MWMS, FLAT) or mode in EXCHANGE_MODES:  # uncompressed / any spec
                continue
            flags = mode_flags(mode)
            local = "--local-sgd" in flags or "--diloco" in flags  # (DiLoCo: local SGD outside)
            period = int(flags[flags.index("--diloco") + 1]) if "--diloco" in flags else \
                int(flags[-1]) if local else 1
            delay = int(flags[-1]) if "--delay" in flags else 0
            for s in specs_of(spec):
                try:
                    check_local_args(local, period, 0, delay, True, s)
                except ValueError as exc:
                    raise ValueError(f"{spec} in mode {mode}: {exc}") from None


def optimizer_of(row: dict) -> str:
    """A row's optimizer: "" where the example has no choice (and in rows written before)."""
    return row.get("optimizer") or ""


def method(row: dict) -> str:
    """What a row compares: its compression, and its mode when not sync, after its
    optimizer when that is not the example's first (AdamW's rows read as before)."""
    mode = mode_of(row)
    text = row["compression"] if mode == SYNC else f"{row['compression']} ({mode})"
    opt = optimizer_of(row)
    return f"{opt}: {text}" if opt and opt != OPTIMIZERS.get(row.get("example"), ("",))[0] else text


def bandwidth_label(text: str) -> str:
    if text.lower() in (UNCAPPED, "none", "0"):
        return UNCAPPED
    return netcap.format_rate(netcap.parse_rate(text))


def nodes_of(row: dict) -> int:
    """A row's simulated nodes (rows of results written before ``--nodes``: 1)."""
    return int(row.get("nodes") or 1)


def device_of(row: dict) -> str:
    """A row's device (rows of results written before ``--device``: cpu, where they ran)."""
    return row.get("device") or "cpu"


def takes_hierarchy(spec: str) -> bool:
    """Whether some tensor of ``spec`` takes the hierarchical exchange (payloads gathered,
    or integer codes summed: :func:`hvd_compress.core.hierarchy.sharded`)."""
    from ..core import build
    from ..core.hierarchy import sharded
    return any(sharded(build(s)) for s in specs_of(spec))


def gathers(spec: str) -> bool:
    """Whether some tensor of ``spec`` sends packed payloads (not summable)."""
    from ..core import build
    return any(not build(s).summable for s in specs_of(spec))


def plan_runs(args, capped_ok: bool) -> list[RunRow]:
    runs = []
    modes = run_modes(getattr(args, "local_sgd", None), getattr(args, "delay", None),
                      getattr(args, "strategy", "horovod"), getattr(args, "diloco", None),
                      getattr(args, "fragments", 1) or 1)
    nodes = int(getattr(args, "nodes", 1) or 1)
    device = getattr(args, "device", None) or "cpu"  # (compare's main resolves the default)
    if nodes > 1:  # the hierarchical exchange (sync) and the flat one side by side
        modes.insert(1, FLAT)
    for at, exchange in enumerate(getattr(args, "exchange", None) or (), start=2 if nodes > 1 else 1):
        if exchange.startswith("hierarchical") and nodes == 1:
            raise ValueError(f"--exchange {exchange} needs --nodes 2 or more")
        if exchange not in modes:
            modes.insert(at, exchange)

    def add(spec, mode, force=False):
        if mode == FLAT and not takes_hierarchy(spec):
            return  # summable payloads go by one allreduce either way
        if mode in EXCHANGE_MODES and mode != "auto" and not gathers(spec) and not force and \
                not (mode.startswith("hierarchical") and takes_hierarchy(spec)):
            return  # summable payloads: one allreduce whatever the exchange
        for np_ in args.np:
            if np_ == 1 and mode not in (SYNC, MWMS):
                continue  # one worker: local SGD and DGA are plain SGD
            bands = [UNCAPPED] if np_ == 1 else list(args.bandwidth)
            if not capped_ok:
                bands = [UNCAPPED]
            for bw in dict.fromkeys(bands):
                runs.append(RunRow(framework="tensorflow" if mode == MWMS else args.framework,
                                   example=args.example, compression=spec, np=np_, bandwidth=bw,
                                   latency=args.latency if bw != UNCAPPED else "", mode=mode,
                                   nodes=nodes if np_ > 1 else 1, device=device))

    only = getattr(args, "modes_for", None)
    choices = OPTIMIZERS.get(args.example, ())  # (none: the example has no choice)
    asked = getattr(args, "optimizer", None) or choices[:1]
    if not choices or choices[0] in asked:  # AdamW: every compressor, every mode
        for spec in args.compression:
            for mode in modes:
                if mode in (SYNC, FLAT) or (mode != MWMS and (not only or spec in only)):
                    add(spec, mode)
    if MWMS in modes:  # the baseline's rows, once: uncompressed
        add("none", MWMS)
    for run in runs if choices else ():
        run.optimizer = choices[0]
    for name in [o for o in asked if o != choices[0]]:  # the Adam-family methods: one row a setting
        first = len(runs)
        add(getattr(args, "adam_compression", None) or ADAM_COMPRESSION, ADAM_EXCHANGE, force=True)
        for run in runs[first:]:
            run.optimizer = name
    for run in runs:
        run.repeat = 1
    times = int(getattr(args, "repeat", 1) or 1)  # the whole matrix again, each time after the last
    return runs + [RunRow.of(dict(run.items(), repeat=k)) for k in range(2, times + 1) for run in runs]


def repeat_of(row: dict) -> int:
    """Which repetition of its run a row is (``--repeat``; rows written before: 1)."""
    return int(row.get("repeat") or 1)


def run_key(row: dict) -> tuple:
    """What tells runs apart (:data:`RUN_KEYS`), a resumed matrix's rows too: a column its
    results.csv lacked reads as its value then (sync, one node, cpu)."""
    of = {"mode": mode_of, "nodes": lambda r: str(nodes_of(r)), "device": device_of,
          "optimizer": optimizer_of, "repeat": lambda r: str(repeat_of(r))}
    return tuple(of[k](row) if k in of else str(row.get(k, "")) for k in RUN_KEYS)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in text)


def run_name(run: dict) -> str:
    lat = f"_lat{run['latency']}" if run["latency"] else ""
    mode = "" if mode_of(run) == SYNC else "_" + _safe(mode_of(run))
    nodes = f"_{nodes_of(run)}nodes" if nodes_of(run) > 1 else ""
    device = "" if device_of(run) == "cpu" else "_" + device_of(run)
    opt = optimizer_of(run)
    opt = f"_{_safe(opt)}" if opt and opt != OPTIMIZERS.get(run.get("example"), ("",))[0] else ""
    again = f"_r{repeat_of(run)}" if repeat_of(run) > 1 else ""
    return (f"{run['framework']}_{run['example']}{opt}_{_safe(run['compression'])}{mode}_np{run['np']}"
            f"{nodes}_{run['bandwidth']}{lat}{device}{again}")


def specs_of(text: str) -> list:
    """The specs a ``--compression`` value names (a mapping: each of its rules')."""
    from ..core.policy import Policy
    return Policy(text).known_specs()
