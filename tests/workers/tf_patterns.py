"""Bodies for tests/test_tensorflow_patterns.py: Horovod's Keras patterns with our Keras
optimizer and hvd_compress.tensorflow.keras.callbacks, under horovodrun -np 2."""

from __future__ import annotations

import numpy as np

_PAIR = []  # the process set of ranks 0 and 1, once Horovod is up (init_with_pair)


def init_with_pair():
    """Horovod up with the process set of ranks 0 and 1 (every body of the shared np 3
    launch, tests.launches.TF_GLOO3, starts Horovod through this): ``(hvd, the set)``."""
    import horovod.tensorflow as hvd

    from . import started_with_pair
    return started_with_pair(hvd, _PAIR)


def keras_callbacks(spec="topk:ratio=0.5", epochs=3, batch=8, n=32):
    """fit() with each callback; returns, per run, the weights, the per-epoch logs, the
    learning rate at every batch and (ours) the compressor's residuals."""
    import horovod.tensorflow as hvd
    import keras

    import hvd_compress.tensorflow as hct
    cbs = hct.keras.callbacks
    hvd.init()
    rank = hvd.rank()
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((n, 8)).astype("float32")
    y = x[:, :4] * 2.0
    runs = {
        "broadcast": lambda: [cbs.BroadcastGlobalVariablesCallback(0)],
        "no broadcast": lambda: [],
        "metric": lambda: [cbs.MetricAverageCallback()],
        "warmup": lambda: [cbs.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2)],
        "schedule": lambda: [cbs.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1)],
    }
    out = {}
    for name, make in runs.items():
        keras.utils.set_random_seed(rank)  # different initial weights on every rank
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                             compression=spec, min_numel=0)
        model.compile(optimizer=opt, loss="mse")
        lrs = []

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, b, logs=None):
                lrs.append(float(np.asarray(model.optimizer.learning_rate)))

        hist = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False,
                         callbacks=make() + [Record()])
        residuals = [np.asarray(v).tolist() for st in opt.compression.tensor_state.values()
                     for k, v in st.items() if k == "residual"]
        out[name] = {"weights": [w.ravel().tolist() for w in model.get_weights()],
                     "loss": [float(v) for v in hist.history["loss"]], "lr": lrs,
                     "residuals": residuals, "size": hvd.size()}
    return out


def _dense_model(seed=0):
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])


def _data(rank, step, n=16):
    rng = np.random.default_rng(100 * step + rank)
    x = rng.standard_normal((n, 8)).astype("float32")
    return x, (x[:, :4] * 2.0 + rng.standard_normal((n, 4)) * 0.1).astype("float32")


def _tape_step(model, opt, x, y, wrap):
    """One custom-loop step: the local loss, ``wrap(tape)`` (Horovod's or our tape), apply."""
    import keras
    import tensorflow as tf
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    tape, sources = wrap(tape)
    grads = tape.gradient(loss, sources)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return tape


def _flat(model):
    return [np.asarray(w).ravel().tolist() for w in model.get_weights()]


def _barrier():
    """Every rank, before returning: a rank outside a process set must not shut Horovod
    down while the set still exchanges (TensorFlow's Horovod has no barrier())."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    hvd.allreduce(tf.constant(0.0), name="tests.barrier")


def process_set(steps=3):
    """np 3, a process set of ranks 0 and 1 given to Horovod's tape, ours (none, top-k,
    PowerSGD) and our Keras optimizer (none, top-k): per run, the weights after ``steps``
    steps, and what our compressor was bound to (rank, number of ranks)."""
    import keras

    import hvd_compress.tensorflow as hct
    hvd, pair = init_with_pair()
    rank = hvd.rank()
    out = {"rank": rank}

    def run_tape(kind, spec):
        model = _dense_model()
        opt = keras.optimizers.SGD(0.1, momentum=0.5)

        def wrap(tape):
            if kind == "horovod":
                return (hvd.DistributedGradientTape(tape, process_set=pair),
                        [v.value for v in model.trainable_variables])
            return (hct.DistributedGradientTape(tape, compression=comp, process_set=pair,
                                                min_numel=0), model.trainable_variables)

        comp = hct.compressor(spec) if spec else None
        for step in range(steps):
            _tape_step(model, opt, *_data(rank, step), wrap)
        bound = [comp.core.rank, comp.core.world_size] if comp is not None else None
        return {"weights": _flat(model), "bound": bound}

    for kind, spec in (("horovod", None), ("ours", "none"), ("ours", "topk:ratio=0.3"),
                       ("ours", "powersgd:rank=1")):
        out[f"tape:{kind}:{spec}"] = run_tape(kind, spec)
    for spec in ("none", "topk:ratio=0.3"):
        model = _dense_model()
        opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                             compression=spec, min_numel=0, process_set=pair)
        model.compile(optimizer=opt, loss="mse")
        batches = [_data(rank, step) for step in range(steps)]  # the tape's, in order
        model.fit(np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches]),
                  batch_size=len(batches[0][0]), epochs=1, verbose=0, shuffle=False)
        core = getattr(opt.compression, "core", None)
        out[f"keras:{spec}"] = {"weights": _flat(model),
                                "bound": [core.rank, core.world_size] if pair.included()
                                else None}
    _barrier()
    return out


def _state_of(comp):
    """Per tensor (sorted by name): the step counter and the residual."""
    sd = comp.state_dict()["tensors"]
    return {"steps": [int(sd[n]["step"]) for n in sorted(sd)],
            "residuals": [np.asarray(sd[n]["residual"]).ravel().tolist() for n in sorted(sd)
                          if "residual" in sd[n]]}


def broadcast_variables(steps=3):
    """Horovod's TF2 custom-loop pattern: every rank starts from its own weights; after the
    first step, ``hvd.broadcast_variables`` of the model's and the optimizer's variables
    from rank 0.  Per run (Horovod's tape, ours with none, top-k, random-k): the weights
    and our compressor's state.  Then the resume case: rank 0 alone restores a random-k
    compressor's state; the next exchange with and without ``broadcast_compression_state``."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank = hvd.rank()
    out = {"rank": rank}

    def wrapper(kind, comp, model):
        def wrap(tape):
            if kind == "horovod":
                return (hvd.DistributedGradientTape(tape),
                        [v.value for v in model.trainable_variables])
            return (hct.DistributedGradientTape(tape, compression=comp, min_numel=0),
                    model.trainable_variables)
        return wrap

    for kind, spec in (("horovod", None), ("ours", "none"), ("ours", "topk:ratio=0.3"),
                       ("ours", "randomk:ratio=0.3")):
        model = _dense_model(seed=rank)  # a different start on every rank
        opt = keras.optimizers.SGD(0.1, momentum=0.5)
        comp = hct.compressor(spec) if spec else None
        for step in range(steps):
            _tape_step(model, opt, *_data(rank, step), wrapper(kind, comp, model))
            if step == 0:
                if kind == "horovod":  # as Horovod's docs have it: fails on Keras 3
                    try:
                        hvd.broadcast_variables(model.variables, root_rank=0)
                        out["keras_variables_error"] = None
                    except AttributeError as exc:  # (while tracing: before any collective)
                        out["keras_variables_error"] = str(exc)
                # Keras 3: the tf.Variables under the Keras ones; opt.variables is a list
                hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
                hvd.broadcast_variables([v.value for v in opt.variables], root_rank=0)
        out[f"{kind}:{spec}"] = {"weights": _flat(model),
                                 **(_state_of(comp) if spec not in (None, "none") else {})}

    # resume: rank 0 restores a compressor's state (2 steps), the others start afresh
    model = _dense_model(seed=0)
    opt = keras.optimizers.SGD(0.1)
    comp = hct.compressor("randomk:ratio=0.3")
    for step in range(2):
        _tape_step(model, opt, *_data(rank, step), wrapper("ours", comp, model))
    saved = comp.state_dict()
    for sync in (False, True):
        again = hct.compressor("randomk:ratio=0.3")
        if rank == 0:
            again.load_state_dict(saved)
        hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
        if sync:
            hct.broadcast_compression_state(root_rank=0)
        x, y = _data(rank, 7)
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
        grads = hct.DistributedGradientTape(tape, compression=again, min_numel=0).gradient(
            loss, model.trainable_variables)
        out[f"resume:sync={sync}"] = {"grads": [np.asarray(g).ravel().tolist() for g in grads],
                                      **_state_of(again)}
    return out


def join_uneven(steps=3):
    """Uneven data with ``hvd.join()`` in a TF2 custom loop: rank ``r`` takes ``steps - r``
    steps, then joins (the others' exchanges go on, the joined rank adding zeros).
    Horovod's tape and ours (none, and Random-k, whose payload is summed too): the
    weights and join's result (the last rank to join)."""
    import horovod.tensorflow as hvd
    import keras

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank = hvd.rank()
    out = {}
    for kind, spec in (("horovod", None), ("ours", "none"), ("ours", "randomk:ratio=0.3")):
        model = _dense_model()
        opt = keras.optimizers.SGD(0.1)

        def wrap(tape, kind=kind, spec=spec, model=model):
            if kind == "horovod":
                return hvd.DistributedGradientTape(tape), [v.value for v in model.trainable_variables]
            return (hct.DistributedGradientTape(tape, compression=spec, min_numel=0),
                    model.trainable_variables)

        first = _flat(model)
        log = [_logged_step(model, opt, *_data(rank, step), wrap) for step in range(steps - rank)]
        last = hvd.join()
        out[f"{kind}:{spec}"] = {"weights": _flat(model), "last": int(last), "first": first,
                                 "steps": log}
    return out


def _logged_step(model, opt, x, y, wrap):
    """:func:`_tape_step` that returns, by variable name, the local gradients (from a
    tape of their own) and the ones the wrapped tape gave."""
    import keras
    import tensorflow as tf
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    local = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    tape, sources = wrap(tape)
    grads = tape.gradient(loss, sources)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    names = [getattr(v, "path", None) or v.name for v in model.trainable_variables]
    return {"local": {n: np.asarray(g).ravel().tolist() for n, g in zip(names, local)},
            "got": {n: np.asarray(g).ravel().tolist() for n, g in zip(names, grads)}}


def predivide(factor=3.0, spec="threshold:tau=0.05", steps=2):
    """``gradient_predivide_factor`` in a TF2 custom loop: Horovod's tape and ours with none
    at ``factor`` and at 1 (the weights after ``steps`` steps); ours with ``spec`` (whose
    output does not scale with its input) at ``factor`` and at 1, per step the local and
    the averaged gradients; and the refusals of a factor with op=Sum."""
    import horovod.tensorflow as hvd
    import keras

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank = hvd.rank()
    out = {}
    for kind, spec_, f in (("horovod", None, factor), ("horovod", None, 1.0),
                           ("ours", "none", factor), ("ours", spec, factor), ("ours", spec, 1.0)):
        model = _dense_model()
        opt = keras.optimizers.SGD(0.1)

        def wrap(tape, kind=kind, spec_=spec_, f=f, model=model):
            if kind == "horovod":
                return (hvd.DistributedGradientTape(tape, gradient_predivide_factor=f),
                        [v.value for v in model.trainable_variables])
            return (hct.DistributedGradientTape(tape, compression=spec_, min_numel=0,
                                                gradient_predivide_factor=f),
                    model.trainable_variables)

        log = [_logged_step(model, opt, *_data(rank, step), wrap) for step in range(steps)]
        out[f"{kind}:{spec_}:{f}"] = {"weights": _flat(model), "steps": log}
    import tensorflow as tf
    for kind, spec_ in (("horovod", None), ("ours", "none"), ("ours", spec)):
        try:
            with tf.GradientTape() as tape:
                pass
            if kind == "horovod":
                hvd.DistributedGradientTape(tape, op=hvd.Sum, gradient_predivide_factor=factor)
            else:
                hct.DistributedGradientTape(tape, compression=spec_, op=hvd.Sum,
                                            gradient_predivide_factor=factor)
            out[f"refused:{kind}:{spec_}"] = None
        except ValueError as exc:
            out[f"refused:{kind}:{spec_}"] = str(exc)
    return out
