"""``hvd_compress.tensorflow.DistributedGradientTape``: Horovod's tape, with every compressor.

Takes the arguments of ``horovod.tensorflow.DistributedGradientTape`` 0.28.1.
``gradient()`` computes the local gradients, compresses each with per-variable
state keyed by the variable's name, exchanges the payloads with the collective
the compressor needs (``allreduce`` of summable payloads, ``allgather`` of the
packed bytes otherwise), decodes, sums and averages.  It works in eager mode
and inside ``tf.function``.  ``tape.last_stats`` holds the bytes this worker
sent in the last ``gradient()`` call (and, in eager mode, the encode,
communicate and decode milliseconds).

State: a compressor object passed as ``compression`` keeps its state across the
tapes it is given to.  A spec string's state (residuals, accumulators, counters,
DGA's queue) belongs to the variables the tape differentiates -- a tape is made
anew each step, the model is not -- so tapes over one model share it and tapes
over different models never do (see :func:`~.compressors.owned_by`).
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf

from ..core.policy import DEFAULT_MIN_NUMEL, Policy
from ..frontend import choice_of, new_stats
from ..localsteps import check_wrapper_args
from ..processset import check_process_set, exchanges
from .compressors import TFCompressor, TFPolicy, as_compression, owned_by, prepare_exchange
from .exchange import engine, exchange_tensors, hierarchy_of, is_hierarchical, plan, plan_rows, variable_name
from .localsteps import LocalSGD, strategy

__all__ = ["DistributedGradientTape"]


class _DistributedGradientTape(tf.GradientTape):
    def __init__(self, tape, compression, sparse_as_dense, op, gradient_predivide_factor,
                 process_set, backward_passes_per_step=1, persistent=False,
                 watch_accessed_variables=True, local_sgd=False, local_sgd_warmup_steps=0,
                 buffers=(), delay=0, min_numel=DEFAULT_MIN_NUMEL, start_step=0,
                 hierarchical=None):
        # As Horovod does: a tape of the user's tape class that takes over its recording.
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape
        # a compressor or policy object, or a choice whose state the variables own
        self._compression = compression
        self._rule = (min_numel, start_step)
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._bpps = backward_passes_per_step
        self._hierarchical = hierarchical
        self._args = (op, gradient_predivide_factor, local_sgd, local_sgd_warmup_steps, delay,
                      tuple(buffers))
        self._engine = self._local = None
        self._seen = None
        self.last_stats = {}
        #: whether the last gradient() exchanged (True, or a boolean tensor when traced)
        self.exchanged = True

    @property
    def hierarchical(self) -> bool:
        """Whether compressed gradients go by the hierarchical exchange (known after the
        first gradient(); as the torch wrapper's ``hierarchical``)."""
        return is_hierarchical(self._engine)

    @property
    def compression(self):
        """The compressor holding this tape's state (for a spec: known after gradient())."""
        return self._engine.comp if self._engine is not None else \
            (self._compression if isinstance(self._compression, TFCompressor) else None)

    def _bind(self, variables):
        """The engine and local-step strategy for the compressor that owns the state."""
        comp, (min_numel, start_step) = self._compression, self._rule
        if not isinstance(comp, TFPolicy):
            given = comp if isinstance(comp, TFCompressor) else None

            def make():
                return as_compression(comp, min_numel, start_step)
            if given is not None and Policy(given.spec, min_numel, start_step).uniform:
                pass  # the compressor itself
            elif variables:  # the policy (and its counters) belong to the variables
                key = f"{Policy(given.spec if given else comp, min_numel, start_step)}" \
                      f"@{id(given) if given is not None else ''}" \
                      f"@{id(comp) if callable(comp) and given is None else ''}"
                comp = owned_by(variables, key, make)
            else:
                comp = make()
        if self._engine is None or self._engine.comp is not comp:
            op, predivide, local_sgd, warmup, delay, buffers = self._args
            self._engine = engine(comp, op, predivide, self._process_set, self._hierarchical)
            self._local = strategy(self._engine, local_sgd, self._bpps, warmup, delay, buffers)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False):
        grads = super(self.__class__, self).gradient(target, sources, output_gradients)
        return self.exchange(grads, sources)

    @tf.autograph.experimental.do_not_convert
    def exchange(self, grads, sources):
        """Compress, exchange and aggregate ``grads`` (one per variable in ``sources``)."""
        if not exchanges(hvd, self._process_set):
            return grads
        stats = new_stats()
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
            name = variable_name(var, f"grad_{i}")
            pairs.append((i, grad, name))
        self._bind(list(flat_vars))  # all sources: which have a gradient may vary
        comp = self._engine.comp
        if isinstance(comp, TFPolicy):
            comp.settle([(n, tuple(g.shape), g.dtype.name) for _, g, n in pairs])
        prepare_exchange(comp, [g for _, g, _ in pairs], [n for _, _, n in pairs],
                         self._process_set)
        self._engine.agree(lambda: self._plan(pairs))  # at the first exchange of these tensors
        if self._local is not None:
            # the variables and names finish_step() averages
            self._seen = ([flat_vars[i] for i, _, _ in pairs], [name for _, _, name in pairs])
            results = self._local.gradients([g for _, g, _ in pairs], *self._seen, stats)
        elif self._bpps == 1:
            results = self._exchange_now([g for _, g, _ in pairs], [n for _, _, n in pairs],
                                         stats)
        else:
            results = self._accumulate(pairs, stats)
        out = list(flat)
        for (i, _, _), value in zip(pairs, results):
            out[i] = value
        self.last_stats = stats
        return tf.nest.pack_sequence_as(grads, out)

    def _exchange_now(self, grads, names, stats):
        """One exchange: each tensor in a collective of its own, the uncompressed tensors of
        a per-tensor plan together (in the delayed start, all of them)."""
        return exchange_tensors(self._engine, grads, names, stats)

    def plan(self, sources):
        """Per variable of ``sources``: name, shape, dtype, the compressor it travels with
        (once compression has started) and its payload bytes per step."""
        self._bind(list(sources))
        return plan_rows(self._engine.comp, sources)

    def _plan(self, pairs):
        op, predivide, local_sgd, warmup, delay, buffers = self._args
        return plan("tensorflow.DistributedGradientTape", self._engine.comp, op, predivide,
                    self._bpps, [g for _, g, _ in pairs], [n for _, _, n in pairs], local_sgd,
                    warmup, delay, buffers, sparse_as_dense=bool(self._sparse_as_dense),
                    hierarchy=hierarchy_of(self._engine))

    def drain(self):
        """DGA in eager mode: wait for exchanges still in flight (call before the end)."""
        if self._local is not None:
            self._local.drain()

    def finish_step(self):
        """With ``local_sgd``: call after applying this step's gradients.  Every
        ``backward_passes_per_step``-th local step it averages the variables that
        ``gradient()`` saw (and ``buffers``) over the ranks.  Returns whether it
        averaged (a boolean tensor); without local SGD, False."""
        if not self._args[2] or not self._process_set.included():  # local_sgd
            return False
        if self._seen is None or not isinstance(self._local, LocalSGD):
            raise RuntimeError("finish_step() comes after gradient()")
        stats = dict(self.last_stats) or new_stats()
        did = self._local.after_update(*self._seen, stats)
        self.last_stats = stats
        return did

    def _accumulate(self, pairs, stats):
        """Sum gradients locally; exchange the sums every ``backward_passes_per_step``-th
        pass (zeros are returned in between, and ``self.exchanged`` says which)."""
        comp = self._engine.comp
        accs = [comp.accumulator(name, g) for _, g, name in pairs]
        updates = [acc.assign_add(g) for acc, (_, g, _) in zip(accs, pairs)]
        with tf.control_dependencies(updates):
            passes = comp.pass_counter().assign_add(1)
        do = tf.equal(passes % self._bpps, 0)

        def sync():
            outs = self._exchange_now([acc.read_value() for acc in accs],
                                      [name for _, _, name in pairs], stats)
            with tf.control_dependencies(outs):
                resets = [acc.assign(tf.zeros_like(acc)) for acc in accs]
            with tf.control_dependencies(resets):
                return [tf.identity(o) for o in outs]

        def skip():
            return [tf.zeros_like(g) for _, g, _ in pairs]

        if tf.executing_eagerly():
            self.exchanged = bool(do)
            return sync() if self.exchanged else skip()
        self.exchanged = do
        return tf.cond(do, sync, skip)

def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=hvd.global_process_set,
                            backward_passes_per_step=1, *, local_sgd=False,
                            local_sgd_warmup_steps=0, buffers=(), delay=0,
                            min_numel=DEFAULT_MIN_NUMEL, start_step=0, hierarchical=None):
    """Wrap ``gradtape`` so ``gradient()`` returns compressed-exchanged averaged gradients.

    Arguments are those of ``horovod.tensorflow.DistributedGradientTape`` 0.28.1;
    ``compression`` also takes any hvd_compress compressor or a spec string, or a
    per-tensor choice -- a mapping from variable-name patterns to specs (``"pattern=
    spec;..."`` as text) or a callable ``(name, shape, dtype) -> spec``; with
    ``min_numel`` (tensors with fewer elements go uncompressed, all in
    one allreduce; 0: off) and ``start_step`` (the first N exchanges uncompressed), as
    :func:`hvd_compress.torch.DistributedOptimizer`.  ``tape.plan(variables)`` lists
    each variable's compressor and bytes.
    ``device_dense``/``device_sparse`` and ``groups`` are accepted for
    compatibility (each variable is exchanged on its own).  ``process_set``: its ranks
    exchange among themselves, the compressor bound to their number; a rank outside
    gets its own gradients back, as from Horovod's tape.

    ``backward_passes_per_step=N``: each ``gradient()`` call adds the local
    gradients into accumulators kept with the compressor; every N-th call
    exchanges the sums (compressed once) and returns their average over ranks,
    the calls in between return zeros.  ``tape.exchanged`` tells which (a
    boolean tensor inside ``tf.function``): apply the gradients only then.

    ``local_sgd=True`` (see :mod:`hvd_compress.localsteps`): ``gradient()``
    returns this worker's own gradients (after ``local_sgd_warmup_steps``
    synchronous steps); apply them, then call ``tape.finish_step()``, which
    every ``backward_passes_per_step`` steps averages the variables (compressed:
    their change since the last average) and the floating-point ``buffers``.
    ``delay=D``: Delayed Gradient Averaging; ``gradient()`` returns
    ``g_i - g_{i-D} + avg(g_{i-D})`` (the local gradient for the first D steps).
    The step counter and DGA's ring of gradients live with the compressor.
    ``hierarchical``: compressed between nodes only, as
    :func:`hvd_compress.torch.DistributedOptimizer`'s.
    """
    comp = choice_of(compression)
    specs = comp.specs() if isinstance(comp, TFCompressor) else \
        Policy(comp, min_numel, start_step).known_specs()
    check_wrapper_args("hvd_compress.tensorflow.DistributedGradientTape",
                       "horovod.tensorflow.DistributedGradientTape", op == hvd.Average,
                       op == hvd.Adasum, gradient_predivide_factor, backward_passes_per_step,
                       local_sgd, local_sgd_warmup_steps, delay, specs,
                       op_sums=op in (hvd.Average, hvd.Sum), start_step=start_step)
    check_process_set(hvd, process_set)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,),
               dict(_DistributedGradientTape.__dict__))
    return cls(gradtape._tape, comp, sparse_as_dense, op, gradient_predivide_factor, process_set,
               backward_passes_per_step, persistent=gradtape._persistent,
               watch_accessed_variables=getattr(gradtape, "_watch_accessed_variables", True),
               local_sgd=local_sgd, local_sgd_warmup_steps=local_sgd_warmup_steps,
               buffers=buffers, delay=delay, min_numel=min_numel, start_step=start_step,
               hierarchical=hierarchical)
