"""A TensorFlow wrapper's own state: its accumulators and counters, in ``tf.Variable``s.

Besides the compressor's per-tensor state (:mod:`.tensorstate`), the tape and the Keras
optimizer keep their own, typed as :class:`WrapperState`:

* ``passes``: backward passes counted for ``backward_passes_per_step``, with each
  tensor's gradients summed between exchanges (``sums``);
* ``local_steps``: optimizer steps (local SGD, Delayed Gradient Averaging), with local
  SGD's ``anchors`` (each variable after the last average) and a traced DGA step's
  ring of the last D local and averaged gradients (``dga_local``, ``dga_avg``);
* ``policy_steps``: exchanges under a per-tensor policy (its delayed start);
* eager DGA's exchanges in flight (not checkpointed).

Each is a ``tf.Variable`` made on first use, outside any trace, so a traced step reads
and updates it every call.  TensorFlow code makes a new tape every step, so the state
goes with the compressor that holds the tensors' state (:func:`wrapper_state`), and a
checkpoint of that compressor (or of the Keras optimizer tracking it) holds it: under
the names such checkpoints have always had (``counters/<field>`` and
``accumulators/<tensor>``, ``<tensor>/anchor``, ``<tensor>/dga_local``,
``<tensor>/dga_avg``), so a checkpoint from before this module restores as it is.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

__all__ = ["WrapperState", "wrapper_state", "COUNTERS"]

#: the counters, each an int64 variable (checkpointed as ``counters/<name>``)
COUNTERS = ("passes", "local_steps", "policy_steps")


class WrapperState:
    """A wrapper's accumulators and counters (see the module), each field holding its
    variables.  ``keeper``: the compressor whose checkpoints hold them (it tracks a part
    as soon as the part has a variable, so a compressor that never ran a wrapper's
    feature checkpoints as before)."""

    def __init__(self, keeper):
        self._keeper = weakref.ref(keeper)
        self._counters = {}                 # COUNTERS name -> variable
        #: tensor name -> the sum of its gradients since the last exchange
        self.sums = {}
        #: variable name -> its value after local SGD's last average
        self.anchors = {}
        #: tensor name -> DGA's ring of its last D local / averaged gradients (traced)
        self.dga_local, self.dga_avg = {}, {}
        #: eager DGA's exchanges in flight (made by :mod:`.localsteps`)
        self.in_flight = None
        self._parts = tf.Module(name="hvd_compress_wrapper")  # what the keeper tracks

    # -- the counters ----------------------------------------------------------------------
    @property
    def passes(self) -> tf.Variable:
        """Backward passes (one per ``gradient()``), for ``backward_passes_per_step``."""
        return self._counter("passes")

    @property
    def local_steps(self) -> tf.Variable:
        """Optimizer steps taken under local SGD or DGA."""
        return self._counter("local_steps")

    @property
    def policy_steps(self) -> tf.Variable:
        """Exchanges under a per-tensor policy (its delayed start counts them)."""
        return self._counter("policy_steps")

    def counts(self) -> dict:
        """The counters made so far, as Python ints (what the root broadcasts)."""
        return {name: int(var.numpy()) for name, var in self._counters.items()}

    def set_counts(self, counts: dict) -> None:
        """Each counter of ``counts`` set (made if it was not)."""
        for name, value in counts.items():
            self._counter(name).assign(value)

    def _counter(self, name: str) -> tf.Variable:
        var = self._counters.get(name)
        if var is None:
            if name not in COUNTERS:
                raise KeyError(f"no wrapper counter {name!r} (counters: {COUNTERS})")
            with tf.init_scope():  # made once, eagerly, even when first asked in a trace
                var = tf.Variable(tf.constant(0, tf.int64), trainable=False, name=f"hvdc_{name}")
                self._checkpoint("counters", name, var)
            self._counters[name] = var
        return var

    # -- per tensor ------------------------------------------------------------------------
    def sum(self, name: str, like) -> tf.Variable:
        """The variable summing ``name``'s gradients (shaped as ``like``) between exchanges."""
        return self._tensor(self.sums, name, name, like.shape, like.dtype)

    def anchor(self, name: str, like) -> tf.Variable:
        """Local SGD: where variable ``name`` stood after the last average (``like``'s shape)."""
        return self._tensor(self.anchors, name, f"{name}/anchor", like.shape, like.dtype)

    def ring(self, name: str, like, depth: int) -> tuple:
        """DGA inside ``tf.function``: ``name``'s rings of its last ``depth`` local and
        averaged gradients, ``(local, averaged)``, each ``[depth, *like.shape]``."""
        shape = [depth, *like.shape]
        return (self._tensor(self.dga_local, name, f"{name}/dga_local", shape, like.dtype),
                self._tensor(self.dga_avg, name, f"{name}/dga_avg", shape, like.dtype))

    def _tensor(self, field: dict, name: str, key: str, shape, dtype) -> tf.Variable:
        var = field.get(name)
        if var is None:
            with tf.init_scope():
                made = getattr(self._parts, "accumulators", None)
                var = tf.Variable(tf.zeros(shape, dtype), trainable=False,
                                  name=f"hvdc_acc_{len(made) if made is not None else 0}")
                self._checkpoint("accumulators", key, var)
            field[name] = var
        return var

    # -- checkpoints -------------------------------------------------------------------------
    def _checkpoint(self, part: str, key: str, var) -> None:
        """``var`` into the keeper's checkpoints as ``<part>/<key>``.  The part (a dict
        that checkpoints track) goes to the keeper before it holds ``var``: restoring a
        checkpoint into the keeper before this state existed left its values waiting
        under the part's name, and they reach ``var`` as it goes in."""
        held = getattr(self._parts, part, None)
        if held is None:
            setattr(self._parts, part, {})
            held = getattr(self._parts, part)
            keeper = self._keeper()
            if keeper is not None:
                keeper.carry(part, held)
        held[key] = var


#: the wrapper state of each compressor that keeps one (it goes when the compressor goes)
_STATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def wrapper_state(comp) -> WrapperState:
    """The wrapper state that goes with compressor ``comp`` (made on first use): the one of
    ``comp.state_keeper`` -- ``comp`` itself, or for a per-tensor policy over a compressor
    object the user gave, that object, so a checkpoint of what the user holds keeps it."""
    keeper = comp.state_keeper
    state = _STATES.get(keeper)
    if state is None:
        state = _STATES[keeper] = WrapperState(keeper)
    return state
