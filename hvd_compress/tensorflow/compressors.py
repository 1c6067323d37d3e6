"""TensorFlow compressors: the core's algorithms on tf tensors, state in ``tf.Variable``s.

Each compressor runs :mod:`hvd_compress.core` through
:class:`~.backend.TensorFlowBackend` (always the sync-free device path), in
eager mode and inside ``tf.function``.  Per-tensor state (residual, DGC memory,
PowerSGD's Q, the step counter) lives in ``tf.Variable``s made once per tensor
name, outside any trace, so a traced step reads and updates them every call.

Horovod's contract -- ``compress(tensor) -> (tensor, ctx)``,
``decompress(tensor, ctx)`` -- is kept: the summable compressors (``none``,
``fp16``, ``bf16``, ``randomk``, ``powersgd``) work in Horovod's own
``hvd.DistributedGradientTape``; the others raise there, naming ours.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import tensorflow as tf

from .. import spec as specmod
from ..core.base import Encoded, warn_once
from ..frontend import CompressorFrontend, class_names, horovod_builtin_spec, named_class
from ..frontend import compressor as _compressor
from ..pertensor import PolicyFrontend, resolve
from .backend import TensorFlowBackend
from .tensorstate import VariableState, assign_values, make_variables, shared_values
from .wrapperstate import wrapper_state

BACKEND = TensorFlowBackend()

__all__ = ["TFCompressor", "TFPolicy", "compressor", "as_compressor", "as_compression",
           "broadcast_compression_state", *class_names()]


class TFCompressor(tf.Module, CompressorFrontend):
    """A compressor spec bound to the TensorFlow backend.

    A ``tf.Module``: its per-tensor state variables (made on first use), its noise
    generator and the state of the wrappers that run it (:meth:`carry`) are tracked, so
    ``tf.train.Checkpoint(compressor=comp)`` (or a model checkpoint holding the
    optimizer) saves and restores them; restoring before first use is deferred until
    the variables exist.
    """

    BACKEND = BACKEND
    HOROVOD_WRAPPER = "horovod.tensorflow's DistributedGradientTape or DistributedOptimizer"
    OUR_WRAPPER = "hvd_compress.tensorflow.DistributedGradientTape"

    def __init__(self, spec, rank: int | None = None, world_size: int | None = None):
        tf.Module.__init__(self, name="hvd_compress")
        self._init_frontend(spec, rank, world_size)
        self.tensor_state = {}  # tensor name -> {key: tf.Variable}, tracked

    def __repr__(self) -> str:
        return f"TFCompressor({str(self.spec)!r})"

    @property
    def core(self):
        if self._core is None:
            with tf.init_scope():  # the noise generator's state variable is made eagerly
                self._core = self._build_core()
                noise = getattr(self._core, "noise", None)
                if noise is not None:
                    self.noise_generator = noise.gen  # tracked: checkpointed with the state
        return self._core

    def _horovod_rank_size(self):
        return _horovod_rank_size()

    def bind(self, rank: int, world_size: int) -> "TFCompressor":
        """Set this rank and the number of ranks exchanging (a wrapper does, from its
        process set, before every exchange: elastic training changes them).  A core
        built for other numbers is built again: the per-tensor state lives in variables
        and stays, DGC's epoch carries over, the noise generator is seeded from the new
        rank (a traced step keeps the core it was traced with: trace it again)."""
        self._rank, self._world_size = rank, world_size
        old = self._core
        if old is not None and (old.rank, old.world_size) != (rank, world_size):
            self._core = None
            self._keep_epoch(old)
        return self

    # -- state in variables ------------------------------------------------------------
    def _variables(self, meta) -> dict:
        """``meta``'s state variables, ``{field: tf.Variable}`` (made on first use)."""
        vs = self.tensor_state.get(meta.name)
        if vs is None:
            core = self.core
            with tf.init_scope():  # made once, eagerly, even when first seen in a trace
                core.states.pop(meta.name, None)
                vs = make_variables(core.state(meta), len(self.tensor_state))
            self.tensor_state[meta.name] = vs
            vs = self.tensor_state[meta.name]
        return vs

    @contextlib.contextmanager
    def _bound(self, meta):
        """The core's state for ``meta`` is its variables, read and assigned in place."""
        self.core.states[meta.name] = VariableState(self.core.State, self._variables(meta))
        yield

    # -- the wrappers' state, checkpointed with the compressor --------------------------
    @property
    def state_keeper(self) -> "TFCompressor":
        """The compressor whose checkpoints hold the state of the wrappers that run this
        one (:func:`~.wrapperstate.wrapper_state`): itself."""
        return self

    def carry(self, name: str, part) -> None:
        """Checkpoint ``part`` (a trackable: a wrapper's counters or accumulators, see
        :mod:`.wrapperstate`) with this compressor, as its dependency ``name``.  A tape
        is made anew each step; the compressor the tapes share is what a checkpoint
        holds."""
        setattr(self, name, part)

    @property
    def traced(self) -> bool:
        """Whether a ``tf.function`` traced this compressor's encode: that trace keeps the
        payload sizes it was traced with.  Set by :meth:`encode`; a caller that traces the
        step again (:class:`~.callbacks.CompressionWarmupCallback`) clears it."""
        return bool(self.__dict__.get("_traced"))

    @traced.setter
    def traced(self, value: bool) -> None:
        self.__dict__["_traced"] = bool(value)  # (not a tracked tf.Module attribute)

    # -- the protocol, with state bound --------------------------------------------------
    def set_epoch(self, epoch: int) -> bool:
        """DGC's warm-up epoch; returns whether the payload sizes changed.  A step traced
        before keeps the sizes it was traced with, so it must be traced again (Keras:
        :class:`hvd_compress.tensorflow.keras.CompressionWarmupCallback` does it); warns otherwise."""
        changed = CompressorFrontend.set_epoch(self, epoch)
        if changed and self.traced:
            warn_once(f"retrace-{id(self)}",
                      f"{self.spec}: the density changed at epoch {epoch}, but a tf.function "
                      "traced before keeps the payload sizes of its trace; trace the step again "
                      "(with Keras fit, use hvd_compress.tensorflow.keras.CompressionWarmupCallback)")
        return changed

    @tf.autograph.experimental.do_not_convert
    def encode(self, tensor, name: str, noise=None) -> Encoded:
        if not tf.executing_eagerly():
            self.traced = True
        if self.core.passthrough:  # no state to bind
            return self.core.encode(tensor, name, noise=noise)
        meta = self.core.meta_for(tensor, name)
        with self._bound(meta):
            return self.core.encode(tensor, name, noise=noise)

    def rounds(self, meta) -> int:
        return self.core.rounds(meta)

    def round_op(self, round_: int):
        return self.core.round_op(round_)

    @property
    def max_ranks(self):
        return self.core.max_ranks

    @tf.autograph.experimental.do_not_convert
    def next_round(self, enc: Encoded, reduced) -> Encoded:
        with self._bound(enc.meta):
            return self.core.next_round(enc, reduced)

    @tf.autograph.experimental.do_not_convert
    def aggregate(self, received, enc: Encoded, out=None):
        with self._bound(enc.meta):
            return self.core.aggregate(received, enc, out)

    def scaled(self, result, received, enc: Encoded, factor: float):
        return self.core.scaled(result, received, enc, factor)  # (immutable: imul)

    # -- the two-phase exchange (:mod:`hvd_compress.core.twophase`) -------------------------
    def chunked(self, shape) -> bool:
        return self.core.chunked(shape)

    def payload_nbytes(self, meta) -> int:
        return self.core.payload_nbytes(meta)

    @tf.autograph.experimental.do_not_convert
    def decode(self, payload, meta, ctx=None, out=None):
        return self.core.decode(payload, meta, ctx, out)

    def owner_side(self) -> "TFCompressor":
        """The compressor the owners of the two-phase exchange re-encode with (the core's
        ``owner_spec``), a child whose state variables are tracked with this one's, made
        anew (state kept) when its spec changes (DGC's warm-up)."""
        spec = str(self.core.owner_spec())
        own = getattr(self, "owner_compressor", None)
        if own is None or str(own.spec) != str(specmod.parse(spec)) or \
                (own._rank, own._world_size) != (self._rank, self._world_size):
            made = TFCompressor(spec, self._rank, self._world_size)
            if own is not None:
                made.load_state_dict(own.state_dict())
            with tf.init_scope():
                self.owner_compressor = made  # tracked: checkpointed with this compressor
            own = made
        return own

    def state_dict(self) -> dict:
        tensors = {name: {k: (v.numpy() if isinstance(v, tf.Variable) else v)
                          for k, v in vs.items()} for name, vs in self.tensor_state.items()}
        extra = self.core._extra_state()
        return {"spec": str(self.spec), "tensors": tensors, **({"extra": extra} if extra else {})}

    def load_state_dict(self, sd: dict) -> None:
        """``state_dict()``'s form back into the variables: those a tensor has are assigned;
        a tensor without them yet gets them made from the saved fields (every field with
        its saved shape, PowerSGD's Q included: the tensor's own shape is not saved)."""
        for name, saved in sd["tensors"].items():
            loaded = self.core.State.from_dict(saved, lambda value: value)
            vs = self.tensor_state.get(name)
            if vs is None:
                with tf.init_scope():
                    vs = make_variables(loaded, len(self.tensor_state))
                self.tensor_state[name] = vs
            else:
                assign_values(vs, dict(loaded.present()))
        if "extra" in sd:
            self.core._load_extra_state(sd["extra"])

    # -- what the exchange engine reads -----------------------------------------------
    @property
    def B(self):
        return self.BACKEND

    def wire(self, payload):
        return self.core.wire(payload)

    # -- Horovod's contract ---------------------------------------------------------------
    compress = tf.autograph.experimental.do_not_convert(CompressorFrontend.compress)
    decompress = tf.autograph.experimental.do_not_convert(CompressorFrontend.decompress)

    def _protocol(self):
        return self

    def _horovod_collectives(self):
        import horovod.tensorflow as hvd

        from .exchange import HorovodTF
        return HorovodTF(hvd.global_process_set)

    def _contract_name(self, tensor) -> str:
        return _tensor_name(tensor)


class TFPolicy(PolicyFrontend, TFCompressor):
    """A per-tensor policy on TensorFlow tensors (:mod:`hvd_compress.pertensor`): one
    :class:`TFCompressor` per spec, tracked (a checkpoint of the tape's or optimizer's
    holder saves them all).  The delayed start's step counter is a variable of the
    wrappers' state: :meth:`phased` picks the uncompressed or the compressed exchange
    by it (``tf.cond`` inside a traced step)."""

    def __init__(self, policy, given=None):
        tf.Module.__init__(self, name="hvd_compress")
        self._core = None
        self.tensor_state = {}
        self._init_policy(policy, given)
        self.compressors = {}  # spec text -> TFCompressor, tracked for checkpoints

    def __repr__(self) -> str:
        return f"TFPolicy({str(self.policy)!r})"

    def _make_child(self, spec):
        return compressor(spec)

    def _child_protocol(self, child):
        return child

    def _child_added(self, key, comp) -> None:
        self.compressors[key] = comp

    @property
    def core(self):
        raise AttributeError("a per-tensor policy has one core per compressor: see .children")

    @property
    def state_keeper(self) -> TFCompressor:
        """With a compressor object given, that object (a checkpoint of it holds the
        wrappers' accumulators and counters, as before the policy existed); else the
        policy itself."""
        return self._given if self._given is not None else self

    def phased(self, exchange):
        """``exchange()`` (a list of tensors), or, for the first ``start_step`` calls, the
        same with every tensor uncompressed; counts the calls (in the wrappers' state:
        :attr:`~.wrapperstate.WrapperState.policy_steps`)."""
        n = self.policy.start_step
        if n == 0:
            return exchange()
        step = wrapper_state(self).policy_steps

        def dense():
            self.force_dense = True
            try:
                return exchange()
            finally:
                self.force_dense = False

        if tf.executing_eagerly():
            self.policy_step = int(step.numpy())
            out = dense() if self.policy_step < n else exchange()
        else:
            self.policy_step = n  # the branches decide, not the Python counter
            out = tf.cond(step < n, dense, exchange)
        with tf.control_dependencies(list(out)):
            bump = step.assign_add(1)
        with tf.control_dependencies([bump]):
            return [tf.identity(o) for o in out]

    def state_dict(self) -> dict:
        sd = self.policy_state()
        sd["step"] = int(wrapper_state(self).policy_steps.numpy())
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.load_policy_state(sd)
        wrapper_state(self).policy_steps.assign(int(sd.get("step", 0)))


def as_compression(compression, min_numel: int, start_step: int):
    """What a TF wrapper's ``compression=`` becomes: the compressor (a given object as it
    is, a spec as a new one) where one spec goes to every tensor from the first step
    (``min_numel=0``, ``start_step=0``, or ``none``), else a :class:`TFPolicy`."""
    return resolve(compression, min_numel, start_step, TFCompressor, TFPolicy, compressor)


def _tensor_name(tensor) -> str:
    try:
        name = tensor.name  # graph tensors: the same graph, the same names on every rank
    except (AttributeError, ValueError):
        name = None
    return name or "shape" + "x".join(str(d) for d in tensor.shape)


def _horovod_rank_size():
    try:
        import horovod.tensorflow as hvd
        if hvd.is_initialized():
            return hvd.rank(), hvd.size()
    except ImportError:  # pragma: no cover
        pass
    return 0, 1


# -- the state every rank must hold alike -----------------------------------------------------
#: Per-tensor state shared by every rank is told from each rank's own by the core's one
#: list (:data:`hvd_compress.core.base.PER_RANK_STATE`): the step counters (Random-k's
#: indices and DGC's samples are drawn from them) and PowerSGD's Q are taken from the root;
#: residuals, DGC's momentum and accumulation, Signum's momentum -- and the accumulators of
#: ``backward_passes_per_step`` -- are each rank's own and never travel.
@dataclass
class _Sync:
    """The last :func:`broadcast_compression_state`: how many calls so far, and its root."""

    generation: int = 0
    root: int = 0


_SYNC = _Sync()


def broadcast_compression_state(root_rank: int = 0) -> None:
    """Every rank calls it: at each compressor's next exchange (of each tensor), the state
    that must be equal on every rank -- the shared per-tensor state, DGC's warm-up epoch, the
    wrappers' counters (passes, delayed start) -- is taken from ``root_rank``, and the
    ranks check their plan again.  Per-rank state (residuals, momenta) stays each rank's.

    For the resume pattern (``root_rank`` restores a checkpoint, every rank broadcasts the
    variables): without it a compressor restored on one rank only would count other steps
    than the rest.  The elastic states (:mod:`hvd_compress.tensorflow.elastic`) call it at
    every reset and sync.  Inside ``tf.function`` the exchange happens at trace time: a
    step traced before the call must be traced again."""
    _SYNC.generation += 1
    _SYNC.root = int(root_rank)


@tf.autograph.experimental.do_not_convert
def prepare_exchange(comp, grads, names, process_set) -> bool:
    """What a wrapper does before it exchanges ``grads`` (named ``names``) over
    ``process_set``: bind ``comp`` to this rank and the set's size, and, after
    :func:`broadcast_compression_state`, take the root's shared state for these tensors
    (once per tensor; every rank reaches it at the same exchange).  Returns whether a
    new sync began: the wrapper's ranks must check their plan again (new ranks may
    have joined)."""
    import horovod.tensorflow as hvd
    comp.bind(hvd.rank(), process_set.size())
    generation = _SYNC.generation
    if generation == 0:
        return False
    done = comp.__dict__.get("_synced")
    again = done is None or done[0] != generation
    if again:
        done = comp.__dict__["_synced"] = (generation, set())
    todo = [(g, n) for g, n in zip(grads, names) if n not in done[1]]
    if todo:
        with tf.init_scope():
            _take_shared_state(comp, todo, process_set)
        done[1].update(n for _, n in todo)
    return again


def _holder(comp, grad, name):
    """The compressor that keeps ``name``'s state (a policy's: the one it compresses with)."""
    if not isinstance(comp, TFPolicy):
        return comp
    return comp.child(comp.policy.spec_for(name, tuple(grad.shape), tf.as_dtype(grad.dtype).name))


def _take_shared_state(comp, pairs, process_set) -> None:
    import horovod.tensorflow as hvd
    root = _SYNC.root
    held = {}  # key -> (holder, its variables for the tensor)
    for grad, name in pairs:
        holder = _holder(comp, grad, name)
        if holder.core.passthrough:
            continue
        held[f"{holder.spec}|{name}"] = (holder, holder._variables(holder.core.meta_for(grad, name)))
    counters = wrapper_state(comp)
    mine = None
    if hvd.rank() == root:
        mine = {"tensors": {k: shared_values(h.core.State, vs) for k, (h, vs) in held.items()},
                "epochs": {k: getattr(h.core, "epoch", None) for k, (h, _) in held.items()},
                "counters": counters.counts()}
    got = hvd.broadcast_object(mine, root_rank=root, name="hvd_compress.shared_state",
                               process_set=process_set)
    for k, values in got["tensors"].items():
        holder, vs = held[k]
        assign_values(vs, values)
        epoch = got["epochs"][k]
        if epoch is not None and getattr(holder.core, "epoch", None) != epoch:
            holder.core.set_epoch(epoch)  # (the step being traced has the new sizes)
    counters.set_counts(got["counters"])


def __getattr__(name):
    """The named classes (``TopK``, ``QSGD``, ..., ``Compose``), made from the registry."""
    return named_class(TFCompressor, name)


def compressor(spec) -> TFCompressor:
    """A TensorFlow compressor from a spec string, e.g. ``compressor("topk:ratio=0.01")``."""
    return _compressor(TFCompressor, spec)


def spec_of(compression):
    """The validated spec of what ``compression=`` accepts: a compressor, a spec string,
    None (``none``) or Horovod's ``Compression.none/fp16``."""
    if isinstance(compression, TFCompressor):
        return compression.spec
    if compression is None:
        compression = "none"
    if not isinstance(compression, str):
        compression = horovod_builtin_spec(compression)
    return specmod.parse(compression)


def as_compressor(compression) -> TFCompressor:
    """Accept what :func:`spec_of` accepts: a compressor object as it is, anything else
    as a new compressor with its own state."""
    if isinstance(compression, TFCompressor):
        return compression
    return compressor(spec_of(compression))


_OWNED: dict = {}


def owned_by(variables, spec, make=None) -> TFCompressor:
    """The compressor that keeps ``spec``'s state for ``variables`` (made on first use).

    TensorFlow code makes a new tape every step; with a spec string the state --
    residuals, accumulators, counters, DGA's queue -- belongs to the variables the
    tape differentiates (as an optimizer's slots do), so successive tapes over
    one model share it and tapes over different models never do.  Held with a
    weak reference to the first variable: it goes when the model goes.  ``make``: how
    to make it (then ``spec`` is any text naming what it makes)."""
    key_var = variables[0]
    key = (id(key_var), spec if make is not None else str(specmod.parse(spec)),
           tuple(id(v) for v in variables))
    entry = _OWNED.get(key)
    if entry is None or entry[0]() is not key_var:
        entry = (weakref.ref(key_var), make() if make is not None else as_compressor(spec))
        _OWNED[key] = entry
        weakref.finalize(key_var, _OWNED.pop, key, None)  # the state goes with the model
    return entry[1]
