"""Bodies for tests/test_tensorflow_elastic.py: elastic training (``hvd.elastic.run``)
with our tape and our Keras optimizer, on Keras 3, under ``horovodrun --min-np 2
--max-np 3 --host-discovery-script``.

Phase 1, a custom loop with our tape (PowerSGD, inside a ``tf.function`` made in the
elastic function) and ``hct.elastic.TensorFlowState``: two workers, a third joins after
batch 3 (rank 0 rewrites the discovery file, every rank waits for the interrupt at a
commit point).  Phase 2, Keras ``fit`` with our optimizer (top-k) and
``hct.elastic.KerasState`` with Horovod's elastic Keras callbacks: the third worker
leaves in the middle of epoch 1.  Each rank returns what it saw at every step.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

TAPE_SPEC = "powersgd:rank=1"
KERAS_SPEC = "topk:ratio=0.5"
TAPE_BATCHES = 6
JOIN_AFTER = 3       # phase 1: the third worker joins after this batch
EPOCHS = 3
LEAVE_AT = (1, 1)    # phase 2: the third worker leaves at (epoch, batch)


def _data(rank, step, n=16):
    rng = np.random.default_rng(100 * step + rank)
    x = rng.standard_normal((n, 8)).astype("float32")
    return x, (x[:, :4] * 2.0 + rng.standard_normal((n, 4)) * 0.1).astype("float32")


def _model(seed):
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])


def _gathered(values):
    """Every rank's ``values`` (a flat float vector), one row per rank."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    flat = np.concatenate([np.asarray(v, np.float64).ravel() for v in values])
    return hvd.allgather(tf.constant(flat[None, :]), name="tests.elastic.gather").numpy()


def _same_everywhere(values) -> bool:
    rows = _gathered(values)
    return bool(np.all(rows == rows[0]))


def _wait_for_new_hosts(state, hosts_file, slots, limit=180.0):
    """Rank 0 rewrites the discovery file; every rank polls at commit points until Horovod
    raises HostsUpdatedInterrupt (on every rank at once)."""
    import horovod.tensorflow as hvd
    if hvd.rank() == 0:
        with open(hosts_file, "w") as f:
            f.write(f"localhost:{slots}\n")
    start = time.monotonic()
    while time.monotonic() - start < limit:
        time.sleep(0.5)
        state.check_host_updates()
    raise RuntimeError(f"no host update within {limit:.0f}s")


def _bound(comp):
    import horovod.tensorflow as hvd
    core = comp.core
    return [core.rank, core.world_size] == [hvd.rank(), hvd.size()]


def _shared(comp):
    """Per tensor: the step counter and PowerSGD's Q (when kept)."""
    out = []
    for name in sorted(comp.tensor_state):
        vs = comp.tensor_state[name]
        out.append(np.asarray(vs["step"]).ravel())
        if "q" in vs:
            out.append(np.asarray(vs["q"]).ravel())
    return out


def _residuals(comp):
    return [np.asarray(comp.tensor_state[n]["residual"]).ravel().tolist()
            for n in sorted(comp.tensor_state) if "residual" in comp.tensor_state[n]]


def tape_phase(hosts_file, log):
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    model = _model(0)
    opt = keras.optimizers.SGD(0.05, momentum=0.5)
    opt.build(model.trainable_variables)  # the same variables on every rank, joiners too
    comp = hct.compressor(TAPE_SPEC)
    state = hct.elastic.TensorFlowState(model.variables + opt.variables, batch=0)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
        tape = hct.DistributedGradientTape(tape, compression=comp, min_numel=0)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @hvd.elastic.run
    def train(state):
        traced = tf.function(step)  # the world size is fixed in a trace: one per (re)start
        log.append({"event": "start", "size": hvd.size(), "batch": state.batch,
                    "residuals": _residuals(comp) if comp.tensor_state else None})
        while state.batch < TAPE_BATCHES:
            b = state.batch
            traced(*_data(hvd.rank(), b))
            log.append({"event": "step", "batch": b, "size": hvd.size(), "rank": hvd.rank(),
                        "bound": _bound(comp),
                        "weights_agree": _same_everywhere(model.get_weights()),
                        "shared_agree": _same_everywhere(_shared(comp)),
                        "residuals": _residuals(comp),
                        "steps": int(np.asarray(next(iter(comp.tensor_state.values()))["step"]))})
            state.batch = b + 1
            state.commit()
            if state.batch == JOIN_AFTER and hvd.size() == 2:
                _wait_for_new_hosts(state, hosts_file, 3)
        return _flat(model)

    return train(state)


def _flat(model):
    return [np.asarray(w).ravel().tolist() for w in model.get_weights()]


def keras_phase(hosts_file, log):
    import horovod.tensorflow as hvd
    import keras

    import hvd_compress.tensorflow as hct
    el = hct.keras.elastic
    model = _model(0)
    opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=KERAS_SPEC,
                                         min_numel=0)
    model.compile(optimizer=opt, loss="mse")
    state = el.KerasState(model, opt, batch=0, epoch=0)

    class Leave(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            log.append({"event": "batch", "epoch": state.epoch, "batch": batch,
                        "size": hvd.size(), "rank": hvd.rank(), "bound": _bound(opt.compression),
                        "weights_agree": _same_everywhere(model.get_weights()),
                        "residuals": _residuals(opt.compression)})
            if (state.epoch, batch) == LEAVE_AT and hvd.size() == 3:
                _wait_for_new_hosts(state, hosts_file, 2)

    callbacks = [el.CommitStateCallback(state), el.UpdateBatchStateCallback(state),
                 el.UpdateEpochStateCallback(state), Leave()]

    @hvd.elastic.run
    def train(state):
        log.append({"event": "start", "size": hvd.size(), "epoch": state.epoch,
                    "residuals": _residuals(opt.compression)
                    if opt.compression.tensor_state else None})
        x, y = _data(hvd.rank(), 50)
        model.fit(x, y, batch_size=4, epochs=EPOCHS - state.epoch, shuffle=False, verbose=0,
                  callbacks=callbacks)
        return _flat(model)

    return train(state), state.epoch


def horovods_own_states():
    """Horovod 0.28.1's Keras states on Keras 3, with a plain Keras optimizer: the error."""
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvdk
    import keras
    out = {}
    for name, make in (("TensorFlowKerasState", hvd.elastic.TensorFlowKerasState),
                       ("KerasState", hvdk.elastic.KerasState)):
        model = _model(0)
        opt = keras.optimizers.SGD(0.1)
        opt.build(model.trainable_variables)
        try:
            make(model, opt, batch=0)
            out[name] = None
        except Exception as exc:  # noqa: BLE001  (the failure is the finding)
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _partial(out):
    """What this worker saw so far, for the test should it not return."""
    path = os.path.join(os.environ["HVD_TEST_OUTDIR"], f"partial{out['first_rank']}.json")
    with open(path, "w") as f:
        json.dump(out, f)


def elastic(hosts_file):
    """Both phases; returns this worker's log and final weights (a worker that is removed
    returns what it saw before)."""
    import horovod.tensorflow as hvd
    hvd.init()
    out = {"first_rank": hvd.rank(), "first_size": hvd.size(), "pid": os.getpid(),
           "horovod": horovods_own_states(), "tape": [], "keras": []}
    try:
        out["tape_weights"] = tape_phase(hosts_file, out["tape"])
        _partial(out)  # (a worker removed later may be ended by Horovod without a word)
        out["keras_weights"], out["epoch"] = keras_phase(hosts_file, out["keras"])
        out["last_size"] = hvd.size()
    except Exception as exc:  # noqa: BLE001  (the removed worker's way out, recorded)
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out
