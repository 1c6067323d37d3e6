"""A Keras (3) ``DistributedOptimizer`` with every compressor, for ``model.fit``.

    opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.02), compression="onebit",
                                         backward_passes_per_step=2)
    model.compile(optimizer=opt, loss=...)
    model.fit(...)

The wrapped optimizer's class is subclassed (as Horovod does) and its update
step -- Keras' ``_backend_update_step``, which runs once per applied update --
first sends the gradients through :class:`~.exchange.GradientExchange`.  With
``backward_passes_per_step=N`` the optimizer is built with Keras' own
``gradient_accumulation_steps=N``: gradients are averaged locally over N
batches and compressed and exchanged once.  Keras applies gradient clipping
(``clipnorm`` etc.) to the local gradients before the exchange.

The compressor (a ``tf.Module``) is an attribute of the optimizer, so its
state is saved with ``tf.train.Checkpoint(model=model, optimizer=opt)``.
``_backend_update_step`` is Keras 3's (3.15) private API; the tests pin it.
"""

from __future__ import annotations

import horovod.tensorflow as hvd

from ..frontend import new_stats
from .compressors import as_compressor
from .exchange import GradientExchange

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer:
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        stats = new_stats()
        names = [getattr(v, "path", None) or v.name for v in trainable_variables]
        grads = [g if g is None else self._hvdc_exchange.one(g, name, stats)
                 for g, name in zip(grads, names)]
        self.last_stats = stats
        return super(self.__class__, self)._backend_update_step(grads, trainable_variables,
                                                                learning_rate)

    @property
    def compression(self):
        return self._hvdc_exchange.compression


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False, op=hvd.Average,
                         gradient_predivide_factor=1.0, backward_passes_per_step=1,
                         average_aggregated_gradients=True, num_groups=0, groups=None,
                         process_set=hvd.global_process_set):
    """Wrap a Keras 3 optimizer; arguments as ``horovod.tensorflow.keras.DistributedOptimizer``
    (``compression`` also takes a spec string or an hvd_compress compressor)."""
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == hvd.Adasum:
        raise ValueError("op=Adasum is not supported by hvd_compress; use Horovod's optimizer")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    if name is not None:
        config["name"] = name
    methods = {k: v for k, v in _DistributedOptimizer.__dict__.items()
               if k not in ("__dict__", "__weakref__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    opt = cls.from_config(config)
    opt._hvdc_exchange = GradientExchange(as_compressor(compression), op,
                                          gradient_predivide_factor, process_set)
    opt.hvd_compressor = opt._hvdc_exchange.compression  # tracked for checkpoints
    opt.last_stats = new_stats()
    return opt
