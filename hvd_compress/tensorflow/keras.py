"""A Keras (3) ``DistributedOptimizer`` with every compressor, for ``model.fit``.

    opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.02), compression="onebit",
                                         backward_passes_per_step=2)
    model.compile(optimizer=opt, loss=...)
    model.fit(...)

The wrapped optimizer's class is subclassed (as Horovod does) and its update
step -- Keras' ``_backend_update_step``, which runs once per applied update --
first sends the gradients through :class:`the exchange engine (:mod:`hvd_compress.core.exchange`)`.  With
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

from ..core.policy import DEFAULT_MIN_NUMEL
from ..localsteps import check_horovod_args
from ..processset import check_process_set
from . import callbacks  # noqa: F401  (hvd_compress.tensorflow.keras.callbacks, as Horovod's)
from .callbacks import CompressionWarmupCallback  # noqa: F401
from .compressors import as_compression
from .exchange import bind, describe, plan_rows, variable_name
from .localsteps import strategy
from .wrapper import Settings, before_exchange
from .wrapperstate import wrapper_state

__all__ = ["DistributedOptimizer", "CompressionWarmupCallback", "callbacks"]


def __getattr__(name):
    """``hct.keras.elastic``: :mod:`hvd_compress.tensorflow.elastic` (``KerasState`` and
    Horovod's elastic Keras callbacks), imported on first use, as ``hvd.elastic`` is in
    ``horovod.tensorflow.keras``."""
    if name == "elastic":
        import importlib
        return importlib.import_module("hvd_compress.tensorflow.elastic")
    raise AttributeError(name)


class _DistributedOptimizer:
    #: whether compressed gradients cross nodes hierarchically (as the torch wrapper's)
    hierarchical = property(lambda self: self._hvdc_session.hierarchical)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        s, local = self._hvdc_session, self._hvdc_local
        if not s.exchanges():  # outside the set: its own gradients
            return super(self.__class__, self)._backend_update_step(grads, trainable_variables,
                                                                    learning_rate)
        s.begin_step()
        names = [variable_name(v) for v in trainable_variables]
        have = [i for i, g in enumerate(grads) if g is not None]
        sent, sent_names = [grads[i] for i in have], [names[i] for i in have]
        before_exchange(s, sent, sent_names, lambda: self._hvdc_plan(sent, sent_names))
        if local is not None:
            new = local.gradients(sent, [trainable_variables[i] for i in have], sent_names,
                                  s.stats)
        else:
            new = s.exchange(sent, sent_names, describe)
        grads = list(grads)
        for i, g in zip(have, new):
            grads[i] = g
        out = super(self.__class__, self)._backend_update_step(grads, trainable_variables,
                                                               learning_rate)
        if local is not None:
            local.after_update(list(trainable_variables), names, s.stats)
        s.close_step()
        return out

    def average_parameters(self, variables):
        """Local SGD: average ``variables`` (e.g. ``model.trainable_variables``) and the
        buffers over the ranks now, e.g. before evaluating after the last local step."""
        s = self._hvdc_session
        if self._hvdc_local is None or not hasattr(self._hvdc_local, "average"):
            raise RuntimeError("average_parameters() is for local_sgd=True")
        s.begin_step()
        self._hvdc_local.average(list(variables), [variable_name(v) for v in variables],
                                 s.stats)
        s.close_step()

    def drain(self):
        """DGA in eager mode: wait for exchanges still in flight (call before the end)."""
        if self._hvdc_local is not None:
            self._hvdc_local.drain()

    @property
    def compression(self):
        return self._hvdc_session.engine.comp

    @property
    def last_stats(self):
        """The last update's account (:class:`~hvd_compress.core.stats.Stats`)."""
        return self._hvdc_session.last

    def plan(self, variables):
        """Per variable (e.g. ``model.trainable_variables``): name, shape, dtype, the
        compressor it travels with (once compression has started), payload bytes per step."""
        s = self._hvdc_session
        return s.with_exchanges(plan_rows(s.engine.comp, variables))


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False, op=hvd.Average,
                         gradient_predivide_factor=1.0, backward_passes_per_step=1,
                         average_aggregated_gradients=True, num_groups=0, groups=None,
                         process_set=hvd.global_process_set, *, local_sgd=False,
                         local_sgd_warmup_steps=0, buffers=(), delay=0,
                         min_numel=DEFAULT_MIN_NUMEL, start_step=0, hierarchical=None,
                         exchange="auto"):
    """Wrap a Keras 3 optimizer; arguments as ``horovod.tensorflow.keras.DistributedOptimizer``
    (``compression`` also takes a spec string or an hvd_compress compressor).

    ``local_sgd=True``: every batch is this worker's own update, and every
    ``backward_passes_per_step`` updates the workers average the trainable
    variables (compressed: their change since the last average) and the
    floating-point ``buffers`` (pass ``model.non_trainable_variables`` for
    BatchNorm statistics); ``local_sgd_warmup_steps`` synchronous updates come
    first.  ``delay=D``: Delayed Gradient Averaging (see
    :mod:`hvd_compress.localsteps`).  ``compression`` may also be a per-tensor choice,
    with ``min_numel`` and ``start_step``, as for
    :func:`hvd_compress.tensorflow.DistributedGradientTape`; ``opt.plan(variables)``
    lists each variable's compressor and bytes.  ``process_set``: its ranks exchange
    among themselves; a rank outside applies its own gradients.  ``hierarchical``,
    ``exchange``: how payloads travel, as :func:`hvd_compress.torch.DistributedOptimizer`'s."""
    comp = as_compression(compression, min_numel, start_step)
    check_horovod_args(hvd, "hvd_compress.tensorflow.keras.DistributedOptimizer",
                       "horovod.tensorflow.keras.DistributedOptimizer", op,
                       gradient_predivide_factor, backward_passes_per_step, local_sgd,
                       local_sgd_warmup_steps, delay, comp.specs(),
                       getattr(getattr(comp, "policy", None), "start_step", 0))
    check_process_set(hvd, process_set)
    config = optimizer.get_config()
    if backward_passes_per_step > 1 and not local_sgd:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    if name is not None:
        config["name"] = name
    methods = {k: v for k, v in _DistributedOptimizer.__dict__.items()
               if k not in ("__dict__", "__weakref__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    opt = cls.from_config(config)
    settings = Settings(op, gradient_predivide_factor, process_set, hierarchical, local_sgd,
                        backward_passes_per_step, local_sgd_warmup_steps, delay, tuple(buffers),
                        exchange)
    opt._hvdc_session = s = settings.session()
    bind(s, comp)
    # the optimizer's accumulators and counters, checkpointed with its compressor
    opt._hvdc_local = strategy(s, wrapper_state(comp), settings.buffers)
    opt._hvdc_plan = lambda grads, names: settings.plan(
        "tensorflow.keras.DistributedOptimizer", comp, grads, names, hierarchy=s.hierarchy())
    opt.hvd_compressor = comp  # tracked for checkpoints (with the wrapper state it carries)
    return opt
