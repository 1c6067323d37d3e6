"""Elastic training (``hvd.elastic.run``) with our tape and Keras optimizer, on Keras 3.

    import hvd_compress.tensorflow as hct

    state = hct.elastic.TensorFlowKerasState(model, opt, batch=0, epoch=0)   # Keras fit
    state = hct.elastic.TensorFlowState(model.variables + opt.variables, batch=0)  # a tape

    @hvd.elastic.run          # Horovod's own (hct.elastic.run is the same function)
    def train(state): ...

Horovod 0.28.1's ``TensorFlowKerasState`` (and ``KerasState``) fail on Keras 3 with any
optimizer: they call ``optimizer.variables()``, a list in Keras 3.  Its
``TensorFlowState`` (by its source) broadcasts the variables when it is made, and in
``sync()`` only through a TensorFlow 1 session: in TensorFlow 2 a worker that joins
would get no variables.  These two keep Horovod's names, arguments and semantics (``commit()``,
``restore()``, ``sync()``, ``register_reset_callbacks``, extra attributes synced from
rank 0), on Keras 3, and take care of the compressor:

* at every reset and sync the compressors are bound again to this rank and the new
  number of ranks, and the ranks check their plan again (a worker that joins with
  them);
* the compressor state every rank must hold alike (per-tensor step counters,
  PowerSGD's Q, DGC's warm-up epoch, the wrappers' counters) is rank 0's after a sync
  (:func:`~.compressors.broadcast_compression_state`), taken at the next exchange;
* per-rank state (residuals, DGC's momentum and accumulation, Signum's momentum) stays
  with each survivor as it was; a worker that joins starts from zeros; what a worker
  that leaves held back is lost.  ``restore()`` rolls back the model and optimizer,
  not the compressor.

The world size is fixed in a traced step: the Keras state has Keras trace ``fit``'s
step again after a reset; a tape inside your own ``tf.function`` needs a new
``tf.function`` after every reset (make it inside the function ``hvd.elastic.run``
wraps).  Local SGD and Delayed Gradient Averaging are not covered.

Horovod's elastic Keras callbacks (``hvd.elastic.CommitStateCallback``,
``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``) work on Keras 3 with these
states and are re-exported here, with one difference Keras 3 makes: it does not read
``params["steps"]`` back, so after a reset the epoch in progress runs in full instead
of being shortened by ``state.batch``.
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.common.elastic import ObjectState
from horovod.tensorflow.elastic import run
from horovod.tensorflow.keras.elastic import (
    CommitStateCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)

from .compressors import broadcast_compression_state

__all__ = ["TensorFlowState", "TensorFlowKerasState", "KerasState", "run",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "broadcast_compression_state"]


class TensorFlowState(ObjectState):
    """A list of variables (``tf.Variable`` or Keras 3) and extra attributes (``kwargs``),
    committed, restored and synced from rank 0 as Horovod's ``TensorFlowState`` does, in
    TensorFlow 2; with our compressors kept consistent across resets (see the module)."""

    def __init__(self, variables, **kwargs):
        self._variables = list(variables)
        self._saved = None
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)
        self._save_variables()

    @property
    def variables(self) -> list:
        return list(self._variables)

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        for var, value in zip(self.variables, self._saved):
            var.assign(value)
        super().restore()

    def sync(self):
        for i, var in enumerate(self.variables):
            var.assign(hvd.broadcast(tf.convert_to_tensor(var), 0,
                                     name=f"hvd_compress.elastic.{i}"))
        self._save_variables()
        broadcast_compression_state(0)
        super().sync()

    def reset(self):
        """After Horovod's reset (a worker came or went), before the sync."""
        broadcast_compression_state(0)

    def _save_variables(self):
        self._saved = [tf.identity(tf.convert_to_tensor(v)) for v in self.variables]


class TensorFlowKerasState(TensorFlowState):
    """A Keras 3 model and its optimizer (``optimizer`` or the compiled one), as Horovod's
    ``TensorFlowKerasState``: the model's variables and the optimizer's (built here if it
    was not, so that every rank has the same list), plus ``kwargs``."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        if not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        super().__init__([], **kwargs)

    @property
    def variables(self) -> list:
        return list(self.model.variables) + list(self.optimizer.variables)

    def reset(self):
        super().reset()
        if getattr(self.model, "train_function", None) is not None:
            self.model.make_train_function(force=True)  # the step is traced for a world size


KerasState = TensorFlowKerasState
