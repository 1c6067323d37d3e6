#!/usr/bin/env python
"""What the TensorFlow wrapper costs per step: one bare training loop, three exchanges.

    python scripts/bench_wrapper.py                      # np 2, 5 repeats, all three
    python scripts/bench_wrapper.py --repeats 3 --steps 300 --json out.json
    python scripts/bench_wrapper.py --variant ours --variant horovod --mode eager
    python scripts/bench_wrapper.py --variant local --variant horovod --cycle-time 5

The loop is the MultiWorkerMirroredStrategy baseline's (tf_examples/_mwms.py): the
digits CNN of tf_examples/train_digits.py, this worker's shard of the 1,437
training images, batches of ``--batch-size`` (16) drawn from a fresh permutation
every epoch, SGD with momentum 0.9, one ``tf.function`` step (forward, gradients,
exchange, update).  Only the exchange differs:

* ``mwms``    -- TensorFlow's MultiWorkerMirroredStrategy (its collective all-reduce;
  launched as ``python -m hvd_compress.tools.mwms`` launches it);
* ``horovod`` -- Horovod's own ``hvd.DistributedGradientTape`` (no compression);
* ``ours``    -- ``hvd_compress.tensorflow.DistributedGradientTape(compression="none")``;
* ``local``   -- no exchange at all (each worker trains its own copy; not run unless
  named): the step's compute, so a variant's step less this one's is what its exchange
  costs.

The Horovod variants (and ``local``) run under ``horovodrun --gloo -np N``
(``hvd_compress.tools.hvdrun``); every worker takes one share of the cores, as the
examples do.  ``--cycle-time MS`` sets Horovod's ``HOROVOD_CYCLE_TIME`` for them (its
default: 1 ms between the background thread's negotiation cycles).  Each run times
``--steps`` steps after ``--warmup`` untimed ones (tracing included there); the runs
alternate (one of each variant per repeat, the order rotating) so drift falls on
all alike.  Reported per variant: the median over repeats of each run's median step
time, images per second, the ratio to ``mwms`` (``ours/mwms`` is the figure the
target is stated in: at most 1.3) and the median of the per-repeat ratios (each
repeat's runs close together in time: on a shared machine the steadier figure).
``--mode eager`` runs the Horovod variants' step without ``tf.function`` (the
wrappers' per-step Python cost; not for ``mwms``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VARIANTS = ("mwms", "horovod", "ours", "local")
DEFAULT_VARIANTS = VARIANTS[:3]
RESULT = "bench_wrapper result: "  # the line a worker (rank 0) prints its figures on


# -- the worker: one timed run ---------------------------------------------------------------
def _model(keras):
    sys.path.insert(0, str(REPO / "tf_examples"))
    from train_digits import make_model
    return make_model(keras, "cnn")


def _world(variant: str):
    """(rank, size, strategy or None, hvd or None), the thread pool set as the examples set it."""
    import tensorflow as tf

    from hvd_compress.tools import runtools
    if variant == "mwms":
        sys.path.insert(0, str(REPO / "tf_examples"))
        import _mwms
        strategy, rank, size = _mwms.strategy_and_world()
        return rank, size, strategy, None
    import horovod.tensorflow as hvd
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(runtools.worker_threads(hvd.local_size()))
    return hvd.rank(), hvd.size(), None, hvd


def _step_function(variant, mode, model, opt, loss_fn, strategy, hvd):
    """One training step (x, y) -> loss, exchanging as ``variant`` does."""
    import tensorflow as tf
    variables = model.trainable_variables
    if variant == "mwms":
        @tf.function
        def step(x, y):
            def replica(x, y):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))  # (already / the workers)
                grads = tape.gradient(loss, variables)
                opt.apply_gradients(zip(grads, variables))
                return loss
            return strategy.run(replica, args=(x, y))
        return step
    if variant == "local":
        sources = variables

        def wrap(tape):
            return tape
    elif variant == "horovod":
        # Horovod 0.28.1's tape keys sources by tf.Variable.ref(): Keras 3's tf.Variables
        sources = [v.value for v in variables]

        def wrap(tape):
            return hvd.DistributedGradientTape(tape)
    else:
        import hvd_compress.tensorflow as hct
        sources = variables

        def wrap(tape):
            return hct.DistributedGradientTape(tape, compression="none")

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = wrap(tape).gradient(loss, sources)
        opt.apply_gradients(zip(grads, variables))
        return loss
    return tf.function(step) if mode == "function" else step


def worker(args) -> int:
    """Train ``args.steps`` timed steps (after ``args.warmup``); rank 0 prints the figures."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rank, size, strategy, hvd = _world(args.worker)  # (the strategy before anything else)
    import keras
    import numpy as np
    import tensorflow as tf

    from hvd_compress.tools.datasets import digits_split

    xtr, ytr, _, _ = digits_split()
    xtr, ytr = xtr[rank::size, ..., None], ytr[rank::size]
    keras.utils.set_random_seed(args.seed)  # the same initial weights on every worker
    if strategy is not None:
        with strategy.scope():
            model = _model(keras)
            opt = keras.optimizers.SGD(args.lr, momentum=0.9)
            opt.build(model.trainable_variables)
    else:
        model = _model(keras)
        opt = keras.optimizers.SGD(args.lr, momentum=0.9)
        opt.build(model.trainable_variables)
        for v in model.variables:
            v.assign(hvd.broadcast(v.value, root_rank=0, name=f"init.{v.path}"))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = _step_function(args.worker, args.mode, model, opt, loss_fn, strategy, hvd)

    rng = np.random.default_rng(args.seed + rank)
    per_epoch = len(xtr) // args.batch_size
    batches = []  # made before the clock starts: the loop times the step only
    while len(batches) < args.warmup + args.steps:
        order = rng.permutation(len(xtr))
        batches += [order[b * args.batch_size:(b + 1) * args.batch_size] for b in range(per_epoch)]
    data = [(tf.constant(xtr[at]), tf.constant(ytr[at])) for at in batches]
    times, loss = [], None
    for i, (x, y) in enumerate(data[:args.warmup + args.steps]):
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
    final = float(np.asarray(tf.nest.flatten(
        strategy.experimental_local_results(loss) if strategy is not None else loss)[0]))
    timed = times[args.warmup:]
    if rank == 0:
        doc = {"variant": args.worker, "mode": args.mode, "np": size, "steps": len(timed),
               "median_ms": 1e3 * statistics.median(timed),
               "mean_ms": 1e3 * sum(timed) / len(timed),
               "images_per_sec": args.batch_size * size * len(timed) / sum(timed),
               "final_loss": final, "load_average": round(os.getloadavg()[0], 2)}
        print(RESULT + json.dumps(doc), flush=True)
    return 0


# -- the driver: alternating runs --------------------------------------------------------------
def _command(args, variant: str) -> list[str]:
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", variant,
          "--steps", str(args.steps), "--warmup", str(args.warmup),
          "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(args.seed),
          "--mode", "function" if variant == "mwms" else args.mode]
    if variant == "mwms":
        return [sys.executable, "-m", "hvd_compress.tools.mwms", "-np", str(args.np),
                "--timeout", str(args.timeout)] + me
    cycle = [] if args.cycle_time is None else ["--cycle-time-ms", str(args.cycle_time)]
    return [sys.executable, "-m", "hvd_compress.tools.hvdrun", "--gloo", "-np", str(args.np),
            *cycle] + me


def run_one(args, variant: str, log: Path) -> dict:
    """Launch one run of ``variant``; its rank 0's figures (RuntimeError with the log's tail
    when it fails or prints none)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.run(_command(args, variant), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=args.timeout + 30)
        out = proc.stdout + proc.stderr
        rc = proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = "".join(s if isinstance(s, str) else (s or b"").decode(errors="replace")
                      for s in (exc.stdout, exc.stderr))
        rc = 124
    log.write_text(out)
    for line in out.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    tail = "\n".join(out.splitlines()[-15:])
    raise RuntimeError(f"{variant} run failed (exit status {rc}; log {log}):\n{tail}")


def summarise(runs: dict) -> dict:
    """Per variant: the median over runs of their median step times, images/s, the
    ratio to mwms's median and the median of the per-repeat ratios to mwms's run of the
    same repeat (where mwms ran; likewise ours to horovod)."""
    out = {}
    for variant, docs in runs.items():
        med = statistics.median(d["median_ms"] for d in docs)
        out[variant] = {"runs": len(docs), "median_ms": round(med, 3),
                        "load_averages": [d["load_average"] for d in docs],
                        "run_medians_ms": [round(d["median_ms"], 3) for d in docs],
                        "images_per_sec": round(statistics.median(d["images_per_sec"]
                                                                  for d in docs), 1)}
    base = out.get("mwms", {}).get("median_ms")
    for variant, row in out.items():
        row["ratio_to_mwms"] = round(row["median_ms"] / base, 3) if base else None
        row["paired_ratio_to_mwms"] = _paired(runs, variant, "mwms")
    if "horovod" in out and "ours" in out:
        out["ours"]["ratio_to_horovod"] = round(out["ours"]["median_ms"] /
                                                out["horovod"]["median_ms"], 3)
        out["ours"]["paired_ratio_to_horovod"] = _paired(runs, "ours", "horovod")
    return out


def _paired(runs: dict, variant: str, base: str):
    """The median over repeats of ``variant``'s run median over ``base``'s in the same
    repeat (None without ``base``)."""
    if base not in runs or not runs[base]:
        return None
    ratios = [a["median_ms"] / b["median_ms"] for a, b in zip(runs[variant], runs[base])]
    return round(statistics.median(ratios), 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--variant", action="append", choices=VARIANTS,
                    help="a variant to run (repeatable; default: mwms, horovod and ours)")
    ap.add_argument("--np", type=int, default=2, help="workers (default 2)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each variant (default 5)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per run (default 300)")
    ap.add_argument("--warmup", type=int, default=20,
                    help="untimed steps first, tracing included (default 20)")
    ap.add_argument("--batch-size", type=int, default=16, help="per-worker batch (default 16)")
    ap.add_argument("--lr", type=float, default=0.02, help="learning rate (default 0.02)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--mode", choices=("function", "eager"), default="function",
                    help="the Horovod variants' step in a tf.function (default) or eager")
    ap.add_argument("--cycle-time", type=float, metavar="MS",
                    help="HOROVOD_CYCLE_TIME for the Horovod variants (default: Horovod's, 1 ms)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    ap.add_argument("--logs", metavar="DIR", help="keep each run's output here (default: a "
                    "temporary folder, removed)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON ('-': stdout)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)  # one run's worker
    args = ap.parse_args(argv)
    for flag in ("np", "repeats", "steps", "batch_size"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    if args.cycle_time is not None and args.cycle_time <= 0:
        ap.error("--cycle-time must be above 0")
    if args.worker:
        return worker(args)
    variants = list(dict.fromkeys(args.variant or DEFAULT_VARIANTS))
    if args.mode == "eager" and variants == ["mwms"]:
        ap.error("--mode eager is for the Horovod variants (mwms's step is a tf.function)")

    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        runs: dict = {v: [] for v in variants}
        total, done, t0 = args.repeats * len(variants), 0, time.perf_counter()
        for r in range(args.repeats):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order:
                try:
                    doc = run_one(args, variant, logs / f"{variant}-{r}.log")
                except RuntimeError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 1
                runs[variant].append(doc)
                done += 1
                if not args.quiet:
                    print(f"[{done}/{total} {time.perf_counter() - t0:6.1f}s] repeat {r + 1} "
                          f"{variant}: median step {doc['median_ms']:.3f} ms, "
                          f"{doc['images_per_sec']:.0f} images/s (load average "
                          f"{doc['load_average']:.1f})", file=sys.stderr, flush=True)
    figures = summarise(runs)
    result = {"np": args.np, "mode": args.mode, "steps": args.steps, "warmup": args.warmup,
              "batch_size": args.batch_size, "repeats": args.repeats,
              "cycle_time_ms": args.cycle_time, "variants": figures}
    table = sys.stderr if args.json == "-" else sys.stdout  # stdout: the JSON alone
    print(f"{'variant':10s} {'median step ms':>15s} {'images/s':>10s} {'/ mwms':>8s} "
          f"{'paired':>8s}  run medians", file=table)
    for variant, row in figures.items():
        ratio, paired = ("--" if row[k] is None else f"{row[k]:.2f}x"
                         for k in ("ratio_to_mwms", "paired_ratio_to_mwms"))
        print(f"{variant:10s} {row['median_ms']:15.3f} {row['images_per_sec']:10.0f} {ratio:>8s} "
              f"{paired:>8s}  {row['run_medians_ms']}", file=table)
    if "ratio_to_horovod" in figures.get("ours", {}):
        row = figures["ours"]
        print(f"ours / horovod: {row['ratio_to_horovod']:.2f}x (paired "
              f"{row['paired_ratio_to_horovod']:.2f}x)", file=table)
    if args.json:
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
