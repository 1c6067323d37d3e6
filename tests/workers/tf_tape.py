"""Bodies for tests/test_tensorflow_multiprocess.py, run under horovodrun -np 2."""

from __future__ import annotations

import os

import numpy as np

from hvd_compress.core import NumpyBackend
from tests.workers.reference import Reference

NUMPY_TF = NumpyBackend("out_last")  # the reference in TensorFlow's layout (core.layout)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SPECS = ["none", "fp16", "bf16", "topk:ratio=0.1", "randomk:ratio=0.1", "dgc:ratio=0.05",
         "qsgd:levels=7", "terngrad", "onebit", "threshold:tau=0.001", "powersgd:rank=2",
         "topk:ratio=0.1+qsgd:levels=16", "signsgd", "signum", "efsignsgd", "natural", "uniform",
         "eightbit", "sketchml", "thresholdv:tau=0.005", "adaq:ratio=0.2",
         "inceptionn:bound=1e-4", "signsgd:sum=int"]


class _Model:
    """Two dense layers on plain tf.Variables (Horovod's tape wants tf.Variables)."""

    def __init__(self, tf):
        rng = np.random.default_rng(0)
        self.tf = tf
        self.trainable_variables = [
            tf.Variable(rng.standard_normal((12, 16)).astype(np.float32) * 0.3, name="dense/kernel"),
            tf.Variable(np.zeros(16, np.float32), name="dense/bias"),
            tf.Variable(rng.standard_normal((16, 4)).astype(np.float32) * 0.3, name="out/kernel"),
            tf.Variable(np.zeros(4, np.float32), name="out/bias")]

    def __call__(self, x):
        w1, b1, w2, b2 = self.trainable_variables
        return self.tf.matmul(self.tf.nn.relu(self.tf.matmul(x, w1) + b1), w2) + b2


def _model(tf):
    return _Model(tf)


def _batch(tf, rank, step):
    rng = np.random.default_rng(100 * rank + step)
    return (tf.constant(rng.standard_normal((8, 12)).astype(np.float32)),
            tf.constant(rng.integers(0, 4, 8)))


def tape_step(tf, hct, model, loss_fn, comp, tapes=None, **tape_kwargs):
    """A step ``(x, y) -> (local gradients, our tape's)``, each from a tape of its own;
    ``tapes`` (a list) collects our tapes; ``tape_kwargs`` go to
    ``DistributedGradientTape`` (``min_numel=0``: every tensor compressed)."""
    tape_kwargs.setdefault("min_numel", 0)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        local = tape.gradient(loss, model.trainable_variables)
        with tf.GradientTape() as tape2:
            loss2 = loss_fn(y, model(x))
        dtape = hct.DistributedGradientTape(tape2, compression=comp, **tape_kwargs)
        if tapes is not None:
            tapes.append(dtape)
        return local, dtape.gradient(loss2, model.trainable_variables)
    return step_fn


def aggregate_matches_reference(specs=SPECS, steps=2, traced=False, bpps=1):
    """Our tape's averaged gradient equals the numpy core's aggregation of every
    rank's gradient (deterministic compressors).  Stochastic ones draw their own
    noise: eagerly, each rank's payloads are captured and the numpy core's
    aggregation of those must give the tape's gradient (traced, ranks must agree)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    from hvd_compress.core.base import TensorMeta
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = {}
    for spec in specs:
        model = _model(tf)
        comp = hct.compressor(spec)
        ref = Reference(spec, size, NUMPY_TF)

        step_fn = tape_step(tf, hct, model, loss_fn, comp, backward_passes_per_step=bpps)

        fn = tf.function(step_fn) if traced else step_fn
        if traced and comp.core.variable_size:  # sizes known only eagerly: a clear refusal
            x, y = _batch(tf, rank, 0)
            try:
                fn(x, y)
            except NotImplementedError as exc:
                report[spec] = None if "run the step eagerly" in str(exc) else str(exc)
            else:
                report[spec] = "traced step with data-dependent sizes did not refuse"
            continue
        stochastic = comp.core.draws_noise
        worst = None if stochastic and traced else 0.0
        sent = {}  # name -> this rank's payload (stochastic compressors, eagerly)
        if stochastic and not traced:
            encode = comp.encode

            def capture(tensor, name, noise=None, encode=encode, sent=sent):
                enc = encode(tensor, name, noise=noise)
                sent[name] = (enc.payload.numpy(), enc.meta.shape)
                return enc
            comp.encode = capture
        for step in range(steps):
            local = None
            for micro in range(bpps):  # the tape returns zeros until the bpps-th pass
                x, y = _batch(tf, rank, 10 * step + micro)
                g, got = fn(x, y)
                local = g if local is None else [a + b for a, b in zip(local, g)]
                if micro < bpps - 1:
                    assert all(float(tf.reduce_max(tf.abs(t))) == 0.0 for t in got)
            everyone = hvd.allgather_object([g.numpy() for g in local])
            results = hvd.allgather_object([g.numpy() for g in got])
            assert all(np.array_equal(a, b) for a, b in zip(*results)), f"{spec}: ranks disagree"
            names = [getattr(v, "path", None) or v.name for v in model.trainable_variables]
            if stochastic and traced:
                continue  # the noise is TensorFlow's own; the eager run checks the aggregation
            if stochastic:  # the numpy core aggregates the payloads every rank sent
                payloads = hvd.allgather_object(sent)
                expected = {}
                for name in names:  # decoded rank by rank and added in rank order
                    meta = TensorMeta(name, tuple(sent[name][1]), "float32")
                    expected[name] = sum(ref.comps[0].decode(p[name][0], meta) for p in payloads) / size
            else:
                expected = ref.step([dict(zip(names, grads)) for grads in everyone],
                                    [{} for _ in everyone])
            for i, name in enumerate(names):
                expect = expected[name]
                diff = float(np.max(np.abs(got[i].numpy() - expect)))
                worst = max(worst, diff / max(1e-6, float(np.max(np.abs(expect)))))
        report[spec] = worst
    return {"rank": rank, "report": report}


def horovod_own_tape(specs=("fp16", "randomk:ratio=0.1", "powersgd:rank=2")):
    """Summable compressors inside horovod.tensorflow.DistributedGradientTape (whose compress()
    runs in Horovod's traced subgraph); top-k must refuse with a clear error."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = {}
    for spec in specs:
        model = _model(tf)
        comp = hct.compressor(spec)
        lowrank = spec.startswith("powersgd")
        if lowrank:  # the names Horovod's traced subgraph gives the tensors key their Q
            names, encode = {}, comp.encode

            def capture(tensor, name, noise=None, encode=encode, names=names):
                names[tuple(int(d) for d in tensor.shape)] = name
                return encode(tensor, name, noise=noise)
            comp.encode = capture
            ref, worst = Reference(spec, size, NUMPY_TF), 0.0
        for step in range(2 if lowrank else 1):  # PowerSGD: Q's warm start, step 2
            x, y = _batch(tf, rank, step)
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x))
            local = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x))
            got = [g.numpy() for g in hvd.DistributedGradientTape(tape, compression=comp).gradient(
                loss, model.trainable_variables)]
            everyone = hvd.allgather_object(local)
            if lowrank:  # the numpy core's replay of every rank, as torch's test does
                assert len(names) == len(local), names  # (the shapes tell the tensors apart)
                expect = ref.step([{names[g.shape]: g for g in grads} for grads in everyone],
                                  [{} for _ in everyone])
                for g in got:
                    value = expect[names[g.shape]]
                    diff = float(np.max(np.abs(g.astype(np.float64) - value)))
                    worst = max(worst, diff / max(1e-6, float(np.max(np.abs(value)))))
            if step == 0:
                first_local, first_got = local, got
        local, got = first_local, first_got
        mean = [sum(g[i] for g in hvd.allgather_object(local)) / size for i in range(len(local))]
        same_on_ranks = all(np.array_equal(a, b) for a, b in zip(*hvd.allgather_object(got)))
        info = {"ranks_agree": same_on_ranks}
        if lowrank:
            info["err"] = worst
        if spec == "fp16":
            info["err"] = max(float(np.max(np.abs(a - b))) for a, b in zip(got, mean))
        elif spec.startswith("randomk"):
            # first step, empty residual: the kept coordinates carry the exact mean, the rest 0
            info["kept"] = [int(np.count_nonzero(g)) for g in got]
            info["err"] = max(float(np.max(np.abs(np.where(g != 0, g - m, 0.0))))
                              for g, m in zip(got, mean))
        else:  # powersgd: matrices come back as rank-2 projections, no larger than the mean
            info["ranks"] = [int(np.linalg.matrix_rank(g)) for g in got if g.ndim == 2]
            info["shrinks"] = all(np.linalg.norm(g) <= np.linalg.norm(m) * (1 + 1e-5)
                                  for g, m in zip(got, mean) if g.ndim == 2)
            info["vectors_exact"] = max(float(np.max(np.abs(g - m)))
                                        for g, m in zip(got, mean) if g.ndim == 1)
        report[spec] = info
    model = _model(tf)
    x, y = _batch(tf, rank, 0)
    message = ""
    try:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        hvd.DistributedGradientTape(tape, compression=hct.compressor("topk:ratio=0.1")).gradient(
            loss, model.trainable_variables)
    except Exception as exc:  # noqa: BLE001 - TensorFlow may wrap the error
        message = str(exc)
    return {"rank": rank, "report": report, "topk_error": message}


def keras_checkpoint_phase(spec, path, phase, total_steps=6, save_at=3):
    """Custom loop with the Keras DistributedOptimizer; checkpoint (model, optimizer with the
    compressor's state) at save_at; 'resume' restores in a fresh launch and finishes."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank = hvd.rank()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5),
                                         compression=hct.compressor(spec), min_numel=0)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    start = 0
    folder = f"{path}/rank{rank}"
    if phase == "resume":
        ckpt.restore(tf.train.latest_checkpoint(folder)).assert_existing_objects_matched()
        start = save_at
    for s in range(start, total_steps):
        if phase == "run" and s == save_at:
            ckpt.save(f"{folder}/ckpt")
        step(*_batch(tf, rank, s))
    return {"params": [v.numpy().tobytes().hex() for v in model.trainable_variables],
            "iterations": int(opt.iterations.numpy())}


def keras_checkpoint_phases(specs, path, phase):
    """:func:`keras_checkpoint_phase` for several compressors in one launch (one folder
    each), Keras's global state cleared first: the compressors' state is keyed by the
    variables' names, which Keras numbers per process, so both phases name them alike
    whatever bodies ran before them in their launch."""
    import keras
    keras.backend.clear_session()
    return {spec: keras_checkpoint_phase(spec, f"{path}/{i}", phase) for i, spec in enumerate(specs)}


def state_ownership():
    """Who owns TF compressor state: a spec string's state goes with the variables the tape
    differentiates (successive tapes over one model share it, two models never do); one
    compressor object is shared by whoever is given it; each Keras optimizer has its own."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank = hvd.rank()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    a, b = _model(tf), _model(tf)

    def step(model, compression, bpps=1):
        x, y = _batch(tf, rank, 0)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        tape = hct.DistributedGradientTape(tape, compression=compression,
                                           backward_passes_per_step=bpps, min_numel=0)
        tape.gradient(loss, model.trainable_variables)
        return tape

    spec = "topk:ratio=0.1"
    ta1, ta2, tb = step(a, spec), step(a, spec), step(b, spec)
    shared = hct.compressor(spec)
    tx, ty = step(a, shared), step(b, shared)
    # backward_passes_per_step: two models' passes are counted apart
    acc = "onebit"
    first_a, first_b, second_a = step(a, acc, 2), step(b, acc, 2), step(a, acc, 2)
    o1 = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=spec, min_numel=0)
    o2 = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=spec, min_numel=0)
    state = ta1.compression.tensor_state
    kernel = next(k for k in state if k.startswith("dense/kernel"))
    steps = [int(v.numpy()) for v in state[kernel].values()
             if isinstance(v, tf.Variable) and v.dtype == tf.int64]
    return {"same_model_shares": ta1.compression is ta2.compression,
            "models_apart": ta1.compression is not tb.compression,
            "object_shared": tx.compression is shared and ty.compression is shared,
            "steps_on_a": steps,
            "bpps": [bool(first_a.exchanged), bool(first_b.exchanged), bool(second_a.exchanged)],
            "keras_apart": o1.compression is not o2.compression,
            "named": type(hct.TopK(0.1)).__name__}


def keras_dgc_warmup(spec="dgc:ratio=0.01,warmup_epochs=2", epochs=4):
    """Keras fit with DGC's warm-up: per epoch, the bytes the traced step sends
    (``last_stats`` is written while tracing), with CompressionWarmupCallback and with a plain
    set_epoch callback (which leaves the old trace in place, and must warn)."""
    import warnings

    import horovod.tensorflow as hvd
    import keras

    import hvd_compress.tensorflow as hct
    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((64, 30)).astype(np.float32)
    y = rng.integers(0, 4, 64)
    out = {}
    for mode in ("callback", "plain"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((30,)), keras.layers.Dense(40),
                                  keras.layers.Dense(4)])
        comp = hct.compressor(spec)
        opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=comp, min_numel=0)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(True))
        seen = []

        class Record(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                seen.append(int(opt.last_stats["bytes_sent"]))

        class Plain(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                comp.set_epoch(epoch)

        first = hct.keras.CompressionWarmupCallback(opt) if mode == "callback" else Plain()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[first, Record()])
        out[mode] = {"bytes": seen,
                     "warned": any("trace the step again" in str(w.message) for w in caught)}
    return out


def examples_all_workers(late_s: float = 0.3):
    """The TensorFlow examples' meeting point around an evaluation (tf_examples/_common.py
    ``all_workers``), rank 1 reaching it ``late_s`` late: rank 0's main-thread CPU seconds
    and wall seconds in it."""
    import sys
    import time
    from pathlib import Path

    import horovod.tensorflow as hvd
    import tensorflow as tf
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tf_examples"))
    from _common import all_workers
    hvd.init()
    all_workers(hvd, tf)  # start together
    if hvd.rank() == 1:
        time.sleep(late_s)
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    all_workers(hvd, tf)
    return {"cpu_s": time.thread_time() - cpu0, "wall_s": time.perf_counter() - wall0}
