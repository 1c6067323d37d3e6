"""Horovod's Keras callbacks, for Keras 3, and our compressor's own:
``hvd_compress.tensorflow.keras.callbacks``.

Horovod 0.28.1's own (``horovod.tensorflow.keras.callbacks``) call Keras 2 APIs
that Keras 3 removed (``keras.backend.get_value``/``set_value``/``constant``,
``Variable.ref()``) and fail with any optimizer, Horovod's included.  These
keep their names, arguments and semantics and work with Horovod's Keras
optimizer and ours.  One difference: Keras 3 optimizers hold ``momentum`` as
a Python number baked into the traced step, so the schedule callbacks cannot
apply Horovod's one-batch momentum correction (``momentum_correction`` is
accepted and ignored, with a warning when the optimizer has momentum).
"""

from __future__ import annotations

import warnings

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "CompressionWarmupCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """After the first batch, every rank takes ``root_rank``'s model variables and the
    optimizer's variables (slots, iteration count): the same start from random weights
    or a checkpoint on rank 0, as Horovod's.  A compressor's per-rank state (residuals)
    is not an optimizer variable and stays each rank's own."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank, self.device = root_rank, device
        self.broadcast_done = False
        self._local = set()

    def register_local_var(self, var) -> None:
        """Leave ``var`` out of the broadcast (worker-local)."""
        self._local.add(id(var))

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        variables = [v for v in self.model.variables if id(v) not in self._local]
        variables += list(self.model.optimizer.variables)
        with tf.device(self.device):
            for i, v in enumerate(variables):
                v.assign(hvd.broadcast(tf.convert_to_tensor(v), self.root_rank,
                                       name=f"hvd_compress.bcast.{i}"))
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, each metric in ``logs`` becomes its average over the
    ranks (put it before callbacks that read the metrics), as Horovod's."""

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        with tf.device(self.device):
            for metric in sorted(logs):
                value = tf.constant(np.asarray(logs[metric], dtype=np.float64))
                logs[metric] = float(hvd.allreduce(value, name=f"hvd_compress.metric.{metric}",
                                                   op=hvd.Average).numpy())


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """The learning rate ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to
    ``end_epoch``: set at each epoch's first batch (``staircase``), or every batch with a
    fractional epoch; ``multiplier`` a number (``multiplier ** (epoch - start_epoch)``)
    or a function of the epoch, as Horovod's."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.steps_per_epoch = staircase, steps_per_epoch
        self.momentum_correction = momentum_correction
        self.multiplier = multiplier if callable(multiplier) else \
            (lambda epoch: multiplier ** (epoch - start_epoch))
        self.current_epoch = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(f"{type(self).__name__}: cannot tell the steps per epoch; "
                                 "give steps_per_epoch=")
            self.steps_per_epoch = steps
        if self.momentum_correction and getattr(self.model.optimizer, "momentum", 0):
            warnings.warn(f"{type(self).__name__}: Keras 3 fixes momentum in the traced step; "
                          "Horovod's momentum correction is not applied")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._set(self.initial_lr * self.multiplier(epoch))
        elif not self.staircase:
            self._set(self.initial_lr * self.multiplier(epoch + float(batch) / self.steps_per_epoch))

    def _set(self, lr) -> None:
        self.model.optimizer.learning_rate.assign(lr)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warm-up, as Horovod's: over ``warmup_epochs`` the rate goes
    from ``initial_lr / size`` to ``initial_lr``, batch by batch."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / hvd.size() * (epoch * (hvd.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(np.asarray(self.model.optimizer.learning_rate)):g}.")


class CompressionWarmupCallback(keras.callbacks.Callback):
    """Sets DGC's warm-up epoch at the start of every epoch of ``fit`` and, when the
    density changes, has Keras trace its train step again: a traced step keeps the
    payload sizes (DGC's k) it was traced with.  ``compression``: our Keras
    ``DistributedOptimizer`` or its compressor.  Does nothing for other compressors."""

    def __init__(self, compression):
        super().__init__()
        self.compression = getattr(compression, "compression", compression)

    def on_epoch_begin(self, epoch, logs=None):
        comp = self.compression
        holders = [comp, *getattr(comp, "children", {}).values()]  # (a per-tensor policy's)
        traced = {id(c): c.traced for c in holders}
        for c in holders:
            c.traced = False  # (no warning from set_epoch: the step is traced again here)
        if comp.set_epoch(epoch):
            if any(traced.values()):
                self.model.make_train_function(force=True)
        else:
            for c in holders:
                c.traced = traced[id(c)]
