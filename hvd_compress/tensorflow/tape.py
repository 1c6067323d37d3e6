"""``hvd_compress.tensorflow.DistributedGradientTape``: Horovod's tape, with every compressor.

Takes the arguments of ``horovod.tensorflow.DistributedGradientTape`` 0.28.1.
``gradient()`` computes the local gradients and hands them to the tape's
:class:`~hvd_compress.session.Session`, which compresses each with per-variable
state keyed by the variable's name, exchanges, decodes and averages, eagerly or
inside ``tf.function``; ``tape.last_stats`` holds what the last call sent (in eager
mode with the encode, communicate and decode milliseconds).  Which compressor holds
the state (a tape is made anew each step, the model is not): :mod:`.wrapper`.
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf

from ..core.policy import DEFAULT_MIN_NUMEL, Policy
from ..core.stats import Stats
from ..frontend import choice_of
from ..localsteps import check_horovod_args
from ..processset import check_process_set, exchanges, included
from .compressors import TFCompressor
from .exchange import bind, describe, plan_rows, variable_name
from .localsteps import LocalSGD, accumulate, strategy
from .wrapper import Settings, before_exchange, state_holder
from .wrapperstate import wrapper_state

__all__ = ["DistributedGradientTape"]


class _DistributedGradientTape(tf.GradientTape):
    def __init__(self, tape, compression, sparse_as_dense, settings: Settings, persistent=False,
                 watch_accessed_variables=True, min_numel=DEFAULT_MIN_NUMEL, start_step=0):
        # As Horovod does: a tape of the user's tape class that takes over its recording.
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        # compression: a compressor or policy object, or a choice the variables own the state of
        self._tape, self._compression, self._rule = tape, compression, (min_numel, start_step)
        self._sparse_as_dense, self._process_set = sparse_as_dense, settings.process_set
        self._settings = settings
        # (made at the first exchange; the state: the accumulators and counters, see _bind)
        self._session = self._state = self._local = self._seen = None
        #: whether the last gradient() exchanged (True, or a boolean tensor when traced)
        self.exchanged = True

    @property
    def hierarchical(self) -> bool:
        """Whether compressed gradients cross nodes hierarchically (after gradient())."""
        return self._session is not None and self._session.hierarchical

    @property
    def compression(self):
        """The compressor holding this tape's state (for a spec: known after gradient())."""
        return self._engine.comp if self._engine is not None else \
            (self._compression if isinstance(self._compression, TFCompressor) else None)

    @property
    def last_stats(self):
        """What the last ``gradient()`` sent (:class:`~hvd_compress.core.stats.Stats`)."""
        return self._session.last if self._session is not None else Stats()

    @property
    def _engine(self):
        return self._session.engine if self._session is not None else None

    def _bind(self, variables):
        """The engine, wrapper state and local-step strategy for the compressor that
        holds the state."""
        comp = state_holder(self._compression, variables, *self._rule)
        if self._session is None:
            self._session = self._settings.session()
        if self._engine is None or self._engine.comp is not comp:
            bind(self._session, comp)
            self._state = wrapper_state(comp)
            self._local = strategy(self._session, self._state, self._settings.buffers)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False):
        grads = super(self.__class__, self).gradient(target, sources, output_gradients)
        return self.exchange(grads, sources)

    @tf.autograph.experimental.do_not_convert
    def exchange(self, grads, sources):
        """Compress, exchange and aggregate ``grads`` (one per variable in ``sources``)."""
        if not exchanges(hvd, self._process_set):
            return grads
        pairs = []  # (position, dense gradient, variable name)
        flat, flat_vars = tf.nest.flatten(grads), tf.nest.flatten(sources)
        for i, (grad, var) in enumerate(zip(flat, flat_vars)):
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                if not self._sparse_as_dense:
                    raise ValueError(f"variable {var.name!r} has a sparse gradient; compressed "
                                     "exchange needs sparse_as_dense=True")
                grad = tf.convert_to_tensor(grad)
            pairs.append((i, grad, variable_name(var, f"grad_{i}")))
        self._bind(list(flat_vars))  # all sources: which have a gradient may vary
        s = self._session
        grads_, names = [g for _, g, _ in pairs], [n for _, _, n in pairs]
        before_exchange(s, grads_, names, lambda: self._plan(grads_, names))
        s.begin_step()
        if self._local is not None:
            # the variables and names finish_step() averages
            self._seen = ([flat_vars[i] for i, _, _ in pairs], names)
            results = self._local.gradients(grads_, *self._seen, s.stats)
        elif self._settings.backward_passes_per_step == 1:
            results = s.exchange(grads_, names, describe)
        else:
            results, self.exchanged = accumulate(
                self._state, grads_, names, self._settings.backward_passes_per_step,
                lambda gs: s.exchange(gs, names, describe))
        out = list(flat)
        for (i, _, _), value in zip(pairs, results):
            out[i] = value
        s.close_step()
        return tf.nest.pack_sequence_as(grads, out)

    def plan(self, sources):
        """Per variable of ``sources``: name, shape, dtype, the compressor it travels with
        (once compression has started) and its payload bytes per step."""
        self._bind(list(sources))
        return self._session.with_exchanges(plan_rows(self._engine.comp, sources))

    def _plan(self, grads, names):
        return self._settings.plan("tensorflow.DistributedGradientTape", self._engine.comp,
                                   grads, names, sparse_as_dense=bool(self._sparse_as_dense),
                                   hierarchy=self._session.hierarchy())

    def drain(self):
        """DGA in eager mode: wait for exchanges still in flight (call before the end)."""
        if self._local is not None:
            self._local.drain()

    def finish_step(self):
        """With ``local_sgd``: call after applying this step's gradients.  Every
        ``backward_passes_per_step``-th local step it averages the variables that
        ``gradient()`` saw (and ``buffers``) over the ranks.  Returns whether it
        averaged (a boolean tensor); without local SGD, False."""
        if not self._settings.local_sgd or not included(hvd, self._process_set):
            return False
        if self._seen is None or not isinstance(self._local, LocalSGD):
            raise RuntimeError("finish_step() comes after gradient()")
        s = self._session
        s.reopen_step()  # (the averaging counts into the step whose gradients it follows)
        did = self._local.after_update(*self._seen, s.stats)
        s.close_step()
        return did


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=hvd.global_process_set,
                            backward_passes_per_step=1, *, local_sgd=False,
                            local_sgd_warmup_steps=0, buffers=(), delay=0,
                            min_numel=DEFAULT_MIN_NUMEL, start_step=0, hierarchical=None,
                            exchange="auto"):
    """Wrap ``gradtape`` so ``gradient()`` returns compressed-exchanged averaged gradients.

    Arguments are those of ``horovod.tensorflow.DistributedGradientTape`` 0.28.1;
    ``compression`` also takes any hvd_compress compressor or spec string, or a per-tensor
    choice (patterns to specs, ``"pattern=spec;..."``, or a callable ``(name, shape,
    dtype) -> spec``) with ``min_numel`` and ``start_step``, as
    :func:`hvd_compress.torch.DistributedOptimizer`; ``tape.plan(variables)`` lists each
    variable's compressor and bytes.  ``device_dense``/``device_sparse`` and ``groups``
    are accepted for compatibility.  ``process_set``: its ranks exchange among
    themselves; a rank outside gets its own gradients back, as from Horovod's tape.

    ``backward_passes_per_step=N``: each ``gradient()`` adds the local gradients into
    accumulators (kept with the compressor, :mod:`.wrapperstate`); every N-th call exchanges the sums and
    returns their average, the calls in between return zeros (``tape.exchanged`` tells
    which, a boolean tensor inside ``tf.function``: apply the gradients only then).

    ``local_sgd=True`` (:mod:`hvd_compress.localsteps`): ``gradient()`` returns this
    worker's own gradients (after ``local_sgd_warmup_steps`` synchronous steps); apply
    them, then call ``tape.finish_step()``, which every ``backward_passes_per_step``
    steps averages the variables (compressed: their change since the last average)
    and the floating-point ``buffers``.  ``delay=D``: Delayed Gradient Averaging,
    ``gradient()`` returns ``g_i - g_{i-D} + avg(g_{i-D})`` (the local gradient for
    the first D steps).  ``hierarchical``, ``exchange``: as the torch optimizer's.
    """
    comp = choice_of(compression)
    specs = comp.specs() if isinstance(comp, TFCompressor) else \
        Policy(comp, min_numel, start_step).known_specs()
    check_horovod_args(hvd, "hvd_compress.tensorflow.DistributedGradientTape",
                       "horovod.tensorflow.DistributedGradientTape", op, gradient_predivide_factor,
                       backward_passes_per_step, local_sgd, local_sgd_warmup_steps, delay, specs,
                       start_step)
    check_process_set(hvd, process_set)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,),
               dict(_DistributedGradientTape.__dict__))
    settings = Settings(op, gradient_predivide_factor, process_set, hierarchical, local_sgd,
                        backward_passes_per_step, local_sgd_warmup_steps, delay, tuple(buffers),
                        exchange)
    return cls(gradtape._tape, comp, sparse_as_dense, settings, gradtape._persistent,
               getattr(gradtape, "_watch_accessed_variables", True), min_numel, start_step)
