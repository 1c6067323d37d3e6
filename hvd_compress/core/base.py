"""What every compressor shares: input checks, per-tensor state, error feedback,
the protocol's steps and the treatment of non-finite gradients.

Protocol (one tensor, one step; :mod:`.exchange` runs it for lists of tensors)::

    enc = comp.encode(x, name)                       # local: update state, make payload
    for _ in range(comp.rounds(enc.meta) - 1):       # PowerSGD only: extra rounds
        enc = comp.next_round(enc, allreduce_sum(enc.payload))
    if comp.summable:                                # payloads that add up
        total = comp.aggregate(allreduce_sum(enc.payload), enc)
    else:                                            # packed bytes, one buffer per rank
        total = comp.aggregate(allgather(enc.payload), enc)        # list, rank order

``total`` is the dense *sum* over ranks, with ``x``'s shape and dtype; divide
by the number of ranks for the mean.  ``enc.nbytes`` is exactly what this rank
sends (per round, summed).

Non-finite input (NaN or Inf anywhere in ``x``): the step's aggregate for that
tensor is non-finite (NaN throughout for the sparsified and quantized formats;
the offending entries for ``none``/``fp16``/``bf16``), so a loss scaler or the
user sees it just as without compression, and the compressor's state for that
tensor (residual, DGC memory, PowerSGD Q) is left as it was before the step, so
the steps that follow are not poisoned.  On a device no host synchronisation is
needed for this: a 0-d flag scales the payload's float fields.  In host memory
(numpy, CPU tensors), where reading a value is free, the algorithms branch on
finiteness instead and update their state in place -- the same bits, fewer
passes over memory.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backend import NUMPY
from .state import TensorState, is_shared_key, per_rank_keys

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: how far an owner's noise seed is from the workers' (:meth:`Compressor.owner_spec`)
OWNER_SEED = 0x5EED

def __getattr__(name):
    """``PER_RANK_STATE``: every per-rank field name the algorithms' state classes declare
    (:mod:`.state`), read when asked, so that algorithms registered later count."""
    if name == "PER_RANK_STATE":
        return per_rank_keys()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_shared_state(key: str) -> bool:
    """Whether a saved tensor state's key ``key`` must be equal on every rank (no state
    class declares it per-rank; see :mod:`.state`)."""
    return is_shared_key(key)


_WARNED: set = set()


def warn_once(key: str, message: str) -> None:
    """``message`` as a warning, the first time ``key`` is seen in this process."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def zero_nonfinite(B, v, finite):
    """``v`` with NaN/Inf entries set to 0 (``finite``: whether ``v`` has none, 0-d);
    where the backend can branch, the finite case costs no pass over ``v``."""
    return B.cond(finite, lambda: v, lambda: B.where(B.isfinite(v), v, 0.0))


def nan_flag(B, finite, like):
    """1 where ``finite`` (0-d) holds, else NaN: what every float field of a payload is
    multiplied by on a device, so that a non-finite step decodes to NaN."""
    return B.where(finite, B.scalar(1.0, like=like), B.scalar(float("nan"), like=like))


def kept_state(B, finite, new, old):
    """The state a fused step leaves: ``new`` after a finite step, else ``old``.  ``finite``
    is a Python bool (host fast paths), or a 0-d tensor (a device's or TensorFlow's op,
    which has already sent a non-finite step's float values as NaN): then no host
    synchronisation, a ``B.cond``.  The one place fast paths apply the rule for
    non-finite input to the state they return."""
    if isinstance(finite, (bool, np.bool_)):
        return new if finite else old
    return B.cond(finite, lambda: new, lambda: old)


def host_nonfinite(finite) -> bool:
    """Whether a fused encoder's ``finite`` says NaN/Inf in host memory (a Python False): the
    core then runs its reference non-finite step.  A 0-d tensor never does (see
    :func:`kept_state`)."""
    return isinstance(finite, (bool, np.bool_)) and not finite


def ef_sum_host(B, g, residual):
    """Host memory: ``(v, finite)`` with ``v = residual += g`` in place (``g`` itself
    without error feedback, ``residual`` None).  Where ``g`` is not finite the residual is
    not touched; where the float32 sum overflows it is undone (``-= g``) and ``finite``
    is False.  The host encode paths, and host fast paths, start here."""
    finite = bool(B.all_finite(g))
    if residual is None or not finite:
        return g, finite
    v = B.iadd(residual, g)  # the residual buffer now holds grad + residual
    if not bool(B.all_finite(v)):  # float32 overflow: undo, as a non-finite step
        B.isub(v, g)
        return v, False
    return v, True


@dataclass(frozen=True)
class TensorMeta:
    """What every rank knows about a tensor without communicating."""

    name: str
    shape: tuple
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Encoded:
    """One rank's payload for one tensor, plus local context for decoding: ``ctx`` is
    the compressor family's own typed record (a sparsifier's
    :class:`~.sparsifiers.Selection`, PowerSGD's :class:`~.powersgd.Rounds`) or None."""

    payload: Any
    meta: TensorMeta
    nbytes: int
    round: int = 0
    ctx: Any = None


class Compressor:
    """Base class.  Subclasses set ``name``, ``summable`` and implement
    :meth:`_encode`, :meth:`_decode`, :meth:`payload_nbytes`."""

    name = "base"
    summable = False
    #: whether the payload is the tensor itself, averaged by the collective as Horovod
    #: does (``none``): the engine then hands Horovod the user's op and decodes nothing
    passthrough = False
    #: whether this compressor keeps an error-feedback residual (set from ``ef``)
    ef = False
    #: whether payload sizes depend on the values (rows of different lengths per rank;
    #: ``payload_nbytes`` is then the most a tensor can take)
    variable_size = False
    #: whether the aggregate does not scale with the inputs (the majority vote), so that
    #: Horovod's ``gradient_predivide_factor`` does not apply to it
    scale_free = False
    #: whether :meth:`_decode` always returns an array of its own (no view of the payload,
    #: no state or cached array): :meth:`aggregate` then adds the other ranks' decodes
    #: into the first one in place.  Off by default, so a new compressor is safe as written
    fresh_decode = False
    #: the most elements a tensor may have (None: any number)
    max_numel = None
    #: the most ranks whose payloads may be summed (None: any number; integer sums)
    max_ranks = None
    #: whether the summed payload is integer codes, which Horovod's own averaging
    #: allreduce would truncate (:mod:`.intsum`): ours only
    integer_sum = False
    #: whether it applies momentum itself (DGC's momentum correction): a wrapper moves the
    #: wrapped optimizer's momentum into it, and a plan's uncompressed tensors travel
    #: with that momentum (:func:`.policy.dense_spec`)
    owns_momentum = False
    #: whether a later round is computed from an earlier round's sum and the next step
    #: starts from the last round's (PowerSGD: ``Q = M^T orth(sum P)``, warm-starting the
    #: next step's ``Q``), so an exchange cannot be left in flight across steps (Delayed
    #: Gradient Averaging refuses it); the integer sums' first round only shares a scale
    chained_rounds = False
    #: what it keeps per tensor (:mod:`.state`): the fields, each shared or per-rank
    State = TensorState

    def __init__(self, params: dict | None = None, backend=NUMPY, rank: int = 0,
                 world_size: int = 1):
        self.params = dict(params or {})
        self.B = backend
        self.rank = rank
        self.world_size = world_size
        self.ef = bool(self.params.get("ef", self.ef))
        self.states: dict[str, TensorState] = {}

    # -- public protocol --------------------------------------------------------
    @property
    def collective(self) -> str:
        return "allreduce" if self.summable else "allgather"

    def rounds(self, meta: TensorMeta) -> int:
        return 1

    def round_op(self, round_: int):
        """How the payloads of round ``round_`` combine: None (a sum) or
        :data:`~.exchange.MAX`."""
        return None

    @property
    def draws_noise(self) -> bool:
        """Whether encoding draws uniform noise (stochastic rounding), which
        ``encode(noise=)`` may supply instead."""
        return getattr(self, "noise", None) is not None

    def meta_for(self, x, name: str = "") -> TensorMeta:
        B = self.B
        dtype = B.dtype_name(x)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"{self.name}: tensor {name!r} has dtype {dtype}; gradients to "
                            f"compress must be floating point ({', '.join(FLOAT_DTYPES)})")
        meta = TensorMeta(name, tuple(B.shape(x)), dtype)
        if self.max_numel is not None and meta.numel > self.max_numel:
            raise ValueError(f"{self.name}: tensor {name!r} has {meta.numel:,} elements, more than "
                             f"its payload's int32 counts hold ({self.max_numel:,}); split it or "
                             "compress it with another method")
        if meta.numel == 0:
            raise ValueError(f"{self.name}: tensor {name!r} is empty (shape {meta.shape}); "
                             "there is nothing to compress (send it uncompressed or skip it)")
        return meta

    def encode(self, x, name: str = "", noise=None) -> Encoded:
        """Compress ``x`` (updating this tensor's state) into this rank's payload."""
        meta = self.meta_for(x, name)
        B = self.B
        g = self._flatten(x, meta)
        st = self.state(meta, like=g)
        enc = self._encode_fused(g, meta, st, noise)
        if enc is None:
            enc = (self._encode_host if B.is_host(g) else self._encode_device)(g, meta, st, noise)
        st.step = st.step + 1
        return enc

    def _flatten(self, x, meta) -> Any:
        """``x`` as the flat float32 vector that is encoded (row-major; an algorithm that
        reorders it undoes that in :meth:`_finish`)."""
        return self.B.cast(self.B.reshape(x, (-1,)), "float32")

    def _encode_fused(self, g, meta, st, noise) -> Encoded | None:
        """The step as the backend's fast path (``B.fused_encoder``), or None: then the
        chain of array operations runs (here always; the quantizers override it)."""
        return None

    def _encode_host(self, g, meta, st, noise) -> Encoded:
        """Host memory: branch on finiteness and update the residual in place."""
        v, finite = ef_sum_host(self.B, g, st.residual if self.ef else None)
        if not finite:
            return self._encode_host_nonfinite(g, meta, st, noise)
        enc = self._encode(v, meta, st, noise, None)
        if self.ef:
            self._subtract_sent(v, enc)  # what stays behind is the new residual
        return enc

    def _encode_host_nonfinite(self, g, meta, st, noise) -> Encoded:
        """Host memory, NaN/Inf in ``g`` or in its sum with the residual: a payload that
        decodes to NaN, from the finite entries; the state is not touched."""
        B = self.B
        v = g + st.residual if self.ef else g
        clean = B.where(B.isfinite(v), v, 0.0)
        return self._encode(clean, meta, st, noise, B.scalar(float("nan"), like=g))

    def _encode_device(self, g, meta, st, noise) -> Encoded:
        """Device memory: no value reaches the host; a 0-d flag carries finiteness."""
        B = self.B
        v = g + st.residual if self.ef else g
        finite = B.all_finite(v)
        clean = zero_nonfinite(B, v, finite)
        flag = nan_flag(B, finite, v)
        enc = self._encode(clean, meta, st, noise, flag)
        if self.ef:
            old = st.residual
            st.residual = B.cond(finite, lambda: self._residual_device(clean, enc), lambda: old)
        return enc

    def _residual_device(self, clean, enc: Encoded):
        """``clean - decode(own payload)``, a new tensor (sparsifiers override it cheaply;
        ``clean`` is theirs to reuse)."""
        return clean - self._decode_own(enc)

    def _subtract_sent(self, v, enc: Encoded) -> None:
        """``v -= decode(own payload)`` in place (sparsifiers override it cheaply)."""
        self.B.isub(v, self._decode_own(enc))

    def next_round(self, enc: Encoded, reduced) -> Encoded:
        raise NotImplementedError(f"{self.name} has one round")

    def decode(self, payload, meta: TensorMeta, ctx=None, out=None):
        """Dense tensor (shape and dtype of the input) from one payload.

        ``ctx`` is the encoding rank's :attr:`Encoded.ctx` for compressors whose
        payload leaves out what all ranks share (Random-k's indices).  ``out``
        (optional, the input's shape and dtype) receives the result in place --
        a gradient buffer, say -- and is returned; in host memory this saves
        allocating a dense tensor per step."""
        return self._finish(self._decode(payload, meta, ctx), meta, out)

    def scaled(self, result, received, enc: Encoded, factor: float):
        """``result *= factor`` for :meth:`aggregate`'s ``result`` of ``received`` (the
        average's scaling; in place where the backend can, returned)."""
        return self.B.imul(result, factor)

    def aggregate(self, received, enc: Encoded, out=None):
        """Dense sum over ranks from the allreduced payload or the list of gathered ones.

        ``enc`` is this rank's own :class:`Encoded` for the tensor (its meta and
        local context; PowerSGD needs the latter); ``out`` as in :meth:`decode`."""
        meta = enc.meta
        if self.summable:
            return self.decode(received, meta, enc.ctx, out)
        total = None
        for p in received:
            d = self._decode(p, meta, enc.ctx)
            if total is None:
                total = d
            elif self.fresh_decode:
                # the first decode is this call's own array: added into in place (a fresh
                # sum per rank cost a page-faulting allocation of the whole tensor)
                total = self.B.iadd(total, d)
            else:
                total = total + d
        return self._finish(total, meta, out)

    def wire(self, payload):
        """A summable payload as an allreduce that cannot add bfloat16 carries it:
        bfloat16 bit patterns (``bf16``, ``randomk+bf16``: the only 16-bit integer
        payloads) travel as float16 -- bf16 -> f32 is exact, so this is the one rounding
        of bf16 to f16 -- and the float16 sum decodes as it is."""
        B = self.B
        if B.dtype_name(payload) not in ("uint16", "int16"):
            return payload
        warn_once("bf16", "Horovod cannot allreduce bfloat16: bf16 payloads are rounded to "
                  "bfloat16 and sent as float16 (exact within float16's range)")
        return B.cast(B.from_bfloat16_bits(payload), "float16")

    def reduce_pair(self, a, b):
        """How the allreduce combines two payloads (summable compressors)."""
        return a + b

    def payload_nbytes(self, meta: TensorMeta) -> int:
        raise NotImplementedError

    @property
    def carry_field(self):
        """The state field that holds what error feedback kept back (``"residual"``; None
        without error feedback): where the two-phase exchange puts what a tensor's chunks
        held under another world size (:func:`.twophase.carried_over`)."""
        return "residual" if self.ef else None

    def chunked(self, shape) -> bool:
        """Whether a tensor of ``shape`` may take the two-phase exchange (:mod:`.twophase`;
        DGC sends vectors whole, so they stay in the flat exchange)."""
        return True

    def owner_spec(self):
        """The spec the owners of the two-phase exchange (:mod:`.twophase`) re-encode a
        chunk's sum with: this one, error feedback on (the owner's residual keeps what the
        re-encoding drops) and a noise stream of its own (``seed`` moved by
        :data:`OWNER_SEED`)."""
        parts = []
        for i, part in enumerate(self.spec.parts):
            params = dict(part.params)
            if i == 0 and "ef" in params:
                params["ef"] = True
            if "seed" in params:
                params["seed"] = int(params["seed"]) + OWNER_SEED
            parts.append(type(part)(part.name, params))
        return type(self.spec)(tuple(parts))

    # -- state ----------------------------------------------------------------------
    def state(self, meta: TensorMeta, like=None) -> TensorState:
        """``meta``'s tensor state (:attr:`State`), made on first use or for a new size."""
        st = self.states.get(meta.name)
        if st is None or st.numel != meta.numel:
            st = self._new_state(meta, like)
            self.states[meta.name] = st
        elif like is not None:  # restored from a checkpoint onto another device
            st.align(self.B, like)
        return st

    def _new_state(self, meta: TensorMeta, like) -> TensorState:
        """A fresh state: step 0, a zero residual with error feedback (subclasses add
        their own fields)."""
        residual = self.B.zeros((meta.numel,), "float32", like=like) if self.ef else None
        return self.State(numel=meta.numel, step=0, residual=residual)

    def state_dict(self) -> dict:
        """Per-tensor state as numpy arrays and Python ints (checkpointable): each tensor's
        fields under their names."""
        def plain(v):
            return v if isinstance(v, (int, float, dict)) else np.array(self.B.to_numpy(v), copy=True)

        out = {name: st.to_dict(plain) for name, st in self.states.items()}
        extra = self._extra_state()
        owner = self.__dict__.get("_owner")  # the two-phase exchange's owner (:mod:`.twophase`)
        owner = owner.state_dict() if owner is not None else self.__dict__.get("_owner_state")
        return {"spec": self.params, "tensors": out, **({"extra": extra} if extra else {}),
                **({"owner": owner} if owner is not None else {})}

    def load_state_dict(self, sd: dict) -> None:
        def array(v):
            return v if isinstance(v, (int, float, dict)) else self.B.from_numpy(v)

        self.states = {name: self.State.from_dict(st, array) for name, st in sd["tensors"].items()}
        if "extra" in sd:
            self._load_extra_state(sd["extra"])
        # the owner is made at its first use (:func:`.twophase.owner_of`), with this state
        self.__dict__.pop("_owner", None)
        self.__dict__["_owner_state"] = sd.get("owner")

    def _extra_state(self) -> dict:
        noise = getattr(self, "noise", None)  # the compressor's own noise generator
        return {"noise": noise.state()} if noise is not None else {}

    def _load_extra_state(self, extra: dict) -> None:
        noise = getattr(self, "noise", None)
        if noise is not None and "noise" in extra:
            noise.load(extra["noise"])

    # -- for subclasses -----------------------------------------------------------------
    def _encode(self, v, meta, st, noise, flag) -> Encoded:
        """Payload for flat float32 ``v``.  ``flag`` is None when ``v`` is known finite,
        else a 0-d float (1 or NaN) that every float field of the payload is multiplied by."""
        raise NotImplementedError

    def _decode(self, payload, meta, ctx):
        """Flat float32 values from one payload."""
        raise NotImplementedError

    def _decode_own(self, enc: Encoded):
        return self._decode(enc.payload, enc.meta, enc.ctx)

    def _finish(self, flat, meta: TensorMeta, out=None):
        B = self.B
        dense = B.reshape(flat, meta.shape)
        dense = dense if meta.dtype == "float32" else B.cast(dense, meta.dtype)
        return dense if out is None else B.icopy(out, dense)

    def _flat_out(self, out, meta: TensorMeta):
        """A flat float32 view of ``out`` to decode into, or None (then decode, then copy)."""
        B = self.B
        if out is None or meta.dtype != "float32" or not B.is_host(out):
            return None
        return B.flat_view(out)


class PayloadFastPath:
    """A whole payload from the backend's fused encoder, where it has one for this
    compressor (``B.fused_encoder(self, 1)``; host memory: top-k, adaq, INCEPTIONN;
    TensorFlow on CPU: top-k): the fields it returns are ``{"payload": uint8 array}``, the
    same bytes as the chain's; it may decline a tensor (returns None before touching
    anything).  ``finite`` as for the quantizers' fused encoders: a Python bool (False:
    the reference's non-finite step runs), or a 0-d tensor, with a non-finite step's
    payload already the chain's (values NaN): the state then follows :func:`kept_state`."""

    def _encode_fused(self, g, meta, st, noise):
        B = self.B
        fused = B.fused_encoder(self, 1, like=g)
        if fused is None:
            return None
        done = fused(g, st.residual if self.ef else None, None, None)
        if done is None:  # declined for this tensor (a small one): the chain
            return None
        fields, residual, finite = done
        if host_nonfinite(finite):  # the reference step (the state is untouched)
            return self._encode_host_nonfinite(g, meta, st, noise)
        if self.ef:
            st.residual = kept_state(B, finite, residual, st.residual)
        payload = fields["payload"]
        return Encoded(payload, meta, B.shape(payload)[0])
