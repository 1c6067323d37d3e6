"""Bodies for tests/test_tensorflow_patterns.py: Horovod's Keras patterns with our Keras
optimizer and hvd_compress.tensorflow.keras.callbacks, under horovodrun -np 2."""

from __future__ import annotations

import numpy as np


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
