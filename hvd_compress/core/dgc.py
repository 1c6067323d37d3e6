"""Deep Gradient Compression (Lin, Han, Mao, Wang & Dally, ICLR 2018), as the
authors' implementation (github.com/synxlin/deep-gradient-compression,
``dgc/compression.py`` and its memory) runs it, except where noted below.

Per tensor with two or more dimensions, each step, on every rank:

1. *local gradient clipping* (``clip_norm > 0``): ``g *= min(1, clip_norm /
   (sqrt(N) * ||g||))`` with N ranks, so the sum of N clipped gradients obeys
   the global clipping threshold;
2. *momentum correction*: ``u = m*u + g; v = v + u`` (Nesterov: ``u = m*(u + g);
   v = v + u + g``) -- momentum is applied here, before sparsification, so pair
   DGC with a plain SGD step (no optimizer momentum);
3. *sampled threshold*: with density ``d`` (see the warm-up) and ``k =
   ceil(d*n)``, a tensor of ``n <= ceil(2/d)`` elements is selected exactly
   (its k largest ``|v|``).  A larger one samples ``s = max(ceil(sample_ratio*n),
   ceil(2/d))`` positions (shared by every rank through
   :mod:`~hvd_compress.core.sampling`); the threshold is the ``ceil(d*s)``-th
   largest ``|v|`` of the sample, then a *correction loop* of up to ten rounds
   multiplies it by 0.8 while fewer than 0.8k values pass;
4. the k largest ``|v|`` among the values that pass are sent (all of them when
   fewer pass), as (index, value) pairs in index order -- a fixed-size payload;
   unused slots carry index 0, value 0;
5. *momentum factor masking* (``masking``, on by default): ``v`` keeps what was
   not sent (``v -= sent``) and ``u`` is zeroed where values were sent.

Tensors with fewer than two dimensions (biases, normalisation scales) are sent
whole with momentum applied (``u = m*u + g``, sent as is; Nesterov ``u + g``),
as the authors do (they compress only ``param.dim() > 1`` and apply momentum to
the rest); ``compress_1d=true`` sparsifies them as well.  ``dense=true`` sends every
tensor so, by allreduce (the payload is momentum-corrected values, which add
up): what a per-tensor policy (:mod:`.policy`) sends the uncompressed tensors
of a DGC plan with.  Momentum is linear, so
applying it before the average, as here, equals applying it after.

*Warm-up*: for the first ``warmup_epochs`` epochs the density is
``max(ratio, warmup_coeff ** (epoch + 1))``, by default (``warmup_coeff=0``)
with the authors' coefficient ``ratio ** (1 / (warmup_epochs + 1))``: at 0.1%
and 4 epochs that is 25.1%, 6.3%, 1.6%, 0.4% -- the paper's 75%, 93.75%,
98.4375%, 99.6% sparsity -- then ``ratio``; ``warmup_coeff=0.25`` is the
paper's quartering at any ratio, and ``warmup_coeff=1`` the authors' other
warm-up (their ``wm5o`` config): dense until the warm-up ends.

*Density 1* (``ratio=1``, or a warm-up epoch at density 1): every tensor is
sent with momentum applied (``u`` as is; ``v`` untouched, no masking) --
momentum SGD, as the authors' code, which compresses only while
``compress_ratio < 1`` and otherwise returns ``compensate(accumulate=False)``.
(Masked, as before 0.2.7, every coordinate lost its momentum at every step:
plain SGD.)  It still travels as n (index, value) pairs: a layout without
indices would have to tell density 1 from k = n below it, where a sampled
selection can leave slots empty.  With a quantizer (``dgc+terngrad``) density 1
keeps the sparse path, so that ``v`` keeps the quantizer's error.
The epoch is ``step // steps_per_epoch`` when ``steps_per_epoch`` is given, else
what :meth:`DGC.set_epoch` last set (0 at first).

Where ours differs from the authors' code, and why:

- *More than k pass the threshold*: theirs sends the first k in index order
  when at most 1.3k pass (so high indices can starve) and the k largest of the
  candidates (``resample``) when more pass; ours always sends the k largest, the
  top-k the paper describes.  The threshold is never raised, as theirs with
  ``resample`` (their default) never raises it.  An exactly selected tensor with
  ties at the k-th magnitude keeps the lower indices (theirs: the first k
  indices at or above the k-th magnitude, which can drop larger values).
- *Sample*: theirs is a strided slice with a random start; ours one position
  drawn in each of ``s`` equal strata (the same on every rank, as theirs with
  a common seed).  ``sample_ratio`` is not clamped to at least 1% as theirs is.
- *Weight decay*: theirs applies it in the optimizer with its own momentum
  buffer; here the wrapped optimizer applies it (with the momentum moved into
  DGC, without momentum).
- *Payload*: fixed-size (k slots, unused ones zero) rather than the variable
  count theirs allgathers, so that every rank's row has one size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import Encoded, TensorMeta, kept_state, nan_flag
from .codec import _norm64
from .sampling import stratified_indices, stream_keys
from .sparsifiers import PURPOSE_DGC_SAMPLE, Selection, Sparsifier, count_for, topk_indices
from .state import TensorState, per_rank

ADAPT_ROUNDS = 10
UPPER, LOWER = 1.3, 0.8


def warmup_density(ratio: float, epoch: int, warmup_epochs: int, coeff: float = 0.0) -> float:
    """Fraction of elements sent at ``epoch`` (DGC's exponential warm-up):
    ``max(ratio, coeff ** (epoch + 1))`` during the warm-up, with the authors' default
    ``coeff = ratio ** (1 / (warmup_epochs + 1))`` where ``coeff`` is 0."""
    if epoch < warmup_epochs:
        c = coeff if coeff > 0 else ratio ** (1.0 / (warmup_epochs + 1))
        return max(ratio, c ** (epoch + 1))
    return ratio


def sample_size(n: int, density: float, sample_ratio: float) -> int:
    """Positions sampled to estimate the threshold; ``n`` means exact selection."""
    least = math.ceil(2.0 / density - 1e-9)
    if n <= least:
        return n
    return min(n, max(math.ceil(sample_ratio * n - 1e-9), least))


class Lowering:
    """What DGC's correction loop on a device asks the backend's fast-path hook for
    (``B.fused_encoder(LOWERING, 1, like=mag)``): a callable ``(mag, thr, least, rounds,
    factor)`` giving ``thr`` (0-d float32) times ``factor`` (a float32 product) while
    fewer than ``least`` of ``mag`` are ``>= thr``, ``rounds`` times at most (0-d, on the
    device), or None; a None hook or answer: the loop of :meth:`DGC.threshold`."""

    name = "dgc_lowering"


LOWERING = Lowering()


class MomentumPasses:
    """What DGC's step on a device asks the backend's fast-path hook for
    (``B.fused_encoder(MOMENTUM_PASSES, 1, like=g)``): an object with ``momentum(g, u, v,
    m, nesterov, factor_of)`` -- the new ``(u, v, |v| or None, bad)`` as
    :meth:`DGC._device_step` uses them, or None -- and ``settle(u, v, old_u, old_v, bad,
    sent, masking)``; None: the chain of :meth:`DGC._encode`."""

    name = "dgc_momentum"


MOMENTUM_PASSES = MomentumPasses()


@dataclass(eq=False)
class DGCState(TensorState):
    """DGC's memory: the momentum ``u`` and the accumulation ``v`` (no residual)."""

    u: Any = per_rank()
    v: Any = per_rank()


class DGC(Sparsifier):
    """Deep Gradient Compression; see the module docstring."""

    name = "dgc"
    owns_momentum = True
    State = DGCState

    def __init__(self, params=None, backend=None, rank=0, world_size=1, codec=None):
        params = dict(params or {})
        params["ef"] = False  # DGC keeps its own memory (u, v) instead of a residual
        super().__init__(params, backend, rank, world_size, codec)
        self.epoch = 0

    @staticmethod
    def carried_momentum(params: dict):
        """``(momentum, nesterov, clip_norm)`` that a plan's uncompressed tensors travel
        with next to DGC with ``params`` (:func:`.policy.dense_spec`), None without
        momentum."""
        m = float(params["momentum"])
        if m <= 0:
            return None
        return m, bool(params["nesterov"]), float(params["clip_norm"])

    @classmethod
    def dense_with_momentum(cls, carried) -> str:
        """The spec that sends tensors whole with :meth:`carried_momentum`'s momentum."""
        m, nesterov, clip = carried
        return (f"{cls.name}:momentum={m:g},nesterov={str(nesterov).lower()},"
                f"clip_norm={clip:g},dense=true")

    @staticmethod
    def with_momentum(params: dict, momentum: float, nesterov: bool) -> dict:
        """``params`` taking over an optimizer's momentum (Nesterov kept if either has it)."""
        return {**params, "momentum": momentum, "nesterov": bool(nesterov or params["nesterov"])}

    def set_epoch(self, epoch: int) -> bool:
        """Set the epoch for the warm-up schedule (when ``steps_per_epoch`` is 0); returns
        whether the density, and so every payload's size, changed (a traced TensorFlow
        step keeps the sizes it was traced with: it must then be traced again)."""
        if epoch < 0:
            raise ValueError(f"dgc: epoch must be >= 0, got {epoch}")
        before = self._density_at(self.epoch)
        self.epoch = int(epoch)
        return self._density_at(self.epoch) != before

    def _density_at(self, epoch: int) -> float:
        p = self.params
        return warmup_density(float(p["ratio"]), epoch, int(p["warmup_epochs"]),
                              float(p["warmup_coeff"]))

    def current_epoch(self, step) -> int:
        spe = int(self.params["steps_per_epoch"])
        if spe <= 0:
            return self.epoch
        if not isinstance(step, (int, np.integer)):
            raise ValueError("dgc: steps_per_epoch needs a Python step count, which a traced "
                             "TensorFlow step does not have; call set_epoch(epoch) each epoch "
                             "instead")
        return int(step) // spe

    def density(self, step: int) -> float:
        return self._density_at(self.current_epoch(step))

    @property
    def summable(self) -> bool:
        """``dense=true`` sends momentum-corrected tensors whole: they add up."""
        return bool(self.params.get("dense", False))

    def whole(self, meta) -> bool:
        """Whether ``meta``'s tensor is sent whole (fewer than two dimensions, or
        ``dense``)."""
        return bool(self.params.get("dense", False)) or (
            len(meta.shape) < 2 and not self.params["compress_1d"])

    def momentum_only(self, meta, step) -> bool:
        """Whether this step applies momentum alone (``u`` sent as is; no ``v``, no
        masking): a tensor sent whole, or any tensor at density 1 without a quantizer
        -- the authors compress only while ``compress_ratio < 1``, so at 1 DGC is
        momentum SGD (with a quantizer ``v`` keeps its error, as below 1)."""
        return self.whole(meta) or (self._codec is None and self.density(step) >= 1.0)

    def sends_indices(self, meta) -> bool:
        return not self.whole(meta)

    #: DGC's accumulation ``v`` holds what it has not sent (it has no residual)
    carry_field = "v"

    def chunked(self, shape) -> bool:
        """Tensors sent whole stay whole: only sparsified ones take the two-phase exchange."""
        return not self.whole(TensorMeta("", tuple(shape), "float32"))

    def owner_spec(self):
        """An owner of the two-phase exchange re-selects the largest of its chunk's sum at
        DGC's current density, with error feedback (top-k; its quantizer, if any, after):
        momentum, clipping and masking were the workers'.  The density is the epoch's
        (``set_epoch``), or with ``steps_per_epoch`` the latest step's of any tensor."""
        step = max((int(st.step) for st in self.states.values()
                    if isinstance(st.step, (int, np.integer))), default=1) - 1
        text = f"topk:ratio={self.density(max(step, 0)):.17g},ef=true"
        return text + ("+" + str(self.spec.parts[1]) if self.spec.composed else "")

    def k_for(self, meta, ctx=None) -> int:
        if ctx is not None:
            return ctx.k
        if self.whole(meta):
            return meta.numel
        st = self.states.get(meta.name)
        step = st.step if st is not None else 0
        return count_for(self.density(step), meta.numel)

    def _new_state(self, meta, like):
        st = super()._new_state(meta, like)
        st.u = self.B.zeros((meta.numel,), "float32", like=like)
        st.v = self.B.copy(st.u)
        return st

    def threshold(self, mag, meta, step):
        """The sampled threshold on magnitudes ``mag`` after the correction loop (0-d),
        and whether it is exact (the k-th largest of all of ``mag``)."""
        B = self.B
        n, k = meta.numel, self.k_for(meta)
        s = sample_size(n, self.density(step), float(self.params["sample_ratio"]))
        if s == n:
            return B.kth_largest(mag, k), True
        thr = self.sample_threshold(lambda pos: B.gather(mag, pos), meta, step, like=mag)
        if B.is_host(mag):  # stop as soon as enough pass (the device walk then idles)
            return self.lowered(thr, k, lambda t: B.count_nonzero(mag >= t)), False
        lower = B.fused_encoder(LOWERING, 1, like=mag)  # the rounds as the backend's passes
        done = None if lower is None else lower(mag, thr, math.ceil(LOWER * k), ADAPT_ROUNDS, LOWER)
        if done is not None:
            return done, False
        for _ in range(ADAPT_ROUNDS):  # a fixed number of rounds: no host round-trip
            cnt = B.count_nonzero(mag >= thr)
            thr = B.where(B.cast(cnt, "float64") < LOWER * k, thr * LOWER, thr)
        return thr, False

    def sample_threshold(self, sample_of, meta, step, like=None):
        """The threshold before the correction loop: the ``ceil(d*s)``-th largest of the
        ``s`` sampled magnitudes ``sample_of(positions)`` (0-d)."""
        pos, want = self.sample_plan(meta, step, like=like)
        return self.B.kth_largest(sample_of(pos), want)

    def sample_plan(self, meta, step, like=None):
        """The ``s`` positions sampled (int64, the same on every rank) and the rank
        ``ceil(d*s)`` of the threshold among their magnitudes (1 = the largest)."""
        B = self.B
        density = self.density(step)
        s = sample_size(meta.numel, density, float(self.params["sample_ratio"]))
        key0, key1 = stream_keys(B, int(self.params["seed"]), meta.name, step,
                                 PURPOSE_DGC_SAMPLE, like=like)
        pos, _ = stratified_indices(B, meta.numel, s, key0, key1, like=like)
        return pos, count_for(density, s)  # ceil(d*s), in [1, s]

    @staticmethod
    def lowered(thr, k: int, count):
        """The correction loop in host memory: ``thr *= 0.8`` while ``count(thr)`` (how
        many magnitudes are ``>= thr``) is below ``0.8 k``, ten rounds at most; only
        ever lowered (more than k passing are resampled)."""
        for _ in range(ADAPT_ROUNDS):
            if int(count(thr)) >= LOWER * k:
                break
            thr = thr * LOWER
        return thr

    def _select(self, vacc, meta, st, known=None):
        """``known``: ``(|vacc|, passes)`` from :meth:`_device_step` (the magnitudes its
        momentum pass wrote, and its object's candidate keys), or None."""
        B = self.B
        n, k = meta.numel, self.k_for(meta)
        if self.momentum_only(meta, st.step):
            return B.arange(n, like=vacc), None
        mag = B.abs(vacc) if known is None else known[0]
        thr, exact = self.threshold(mag, meta, st.step)
        if exact:
            return topk_indices(B, mag, k), None
        cap = max(k, math.floor(UPPER * k))
        keyed = None if known is None else known[1].candidate_keys(mag, thr, cap)
        if keyed is not None:
            return self._among_keyed(*keyed, k, n), None
        passed = mag >= thr
        cnt = B.count_nonzero(passed)

        def among_candidates():  # the k largest of at most 1.3k candidates
            cand = B.compact(passed, cap)  # index order, padded with n
            if cap == k:
                return cand
            ok = cand < n
            cmag = B.where(ok, B.gather(mag, B.where(ok, cand, 0)), -1.0)
            return B.gather(cand, topk_indices(B, cmag, k))

        # more than 1.3k candidates: the k largest of all of them is the top-k
        return B.cond(cnt > cap, lambda: topk_indices(B, mag, k),
                      among_candidates), None

    def _among_keyed(self, key, over, k: int, n: int):
        """The branch :meth:`_select`'s ``cond`` takes, computed alone: the top-k of ``key``
        (``mag`` where ``over``, more than ``cap`` passing; else ``mag`` where it passes, -1
        elsewhere), and unless ``over`` only the passing ones, in index order, padded with
        ``n`` -- the k largest of the candidates, or all of them, as ``among_candidates``
        gives them; NaN magnitudes (never candidates) as the full top-k ranks them."""
        B = self.B
        sel = topk_indices(B, key, k)
        pos = B.compact((B.gather(key, sel) >= 0.0) | over, k)  # kept slots, padded with k
        inside = pos < k
        return B.where(inside, B.gather(sel, B.where(inside, pos, 0)), n)

    def _encode_fused(self, g, meta, st, noise):
        """A sampled tensor (not sent whole, no clipping or quantizer): the step as the
        backend's fused encoder, where it has one -- it takes ``(g, state, meta, None)``
        and returns ``(payload, indices, valid, sent, new)``, the chain's bits, or None
        (host memory, NaN/Inf in ``g``: nothing touched; the chain runs).  ``new`` is
        None where it updated ``u`` and ``v`` in place (host memory), else ``(u, v,
        finite)``: new tensors and a 0-d ``finite`` (TensorFlow's op, which sends a
        non-finite step's values as NaN), kept as :func:`~.base.kept_state` says."""
        B = self.B
        if self.momentum_only(meta, st.step) or self._codec is not None \
                or float(self.params["clip_norm"]) > 0:
            return None
        if sample_size(meta.numel, self.density(st.step), float(self.params["sample_ratio"])) \
                == meta.numel:  # selected exactly: the chain
            return None
        fused = B.fused_encoder(self, 1, like=g)
        done = None if fused is None else fused(g, st, meta, None)
        if done is None:
            return None
        payload, indices, valid, sent, new = done
        if new is not None:
            u, v, finite = new
            st.u = kept_state(B, finite, u, st.u)
            st.v = kept_state(B, finite, v, st.v)
        ctx = Selection(self.k_for(meta), indices, valid, sent=sent)
        return Encoded(payload, meta, self.payload_nbytes(meta, ctx), ctx=ctx)

    def _encode(self, g, meta, st, noise, flag) -> Encoded:
        B = self.B
        m = float(self.params["momentum"])
        if float(self.params["clip_norm"]) > 0:
            g = g * self.clip_factor(_norm64(B, g))
        nesterov = bool(self.params["nesterov"])
        plain = self.momentum_only(meta, st.step)
        if flag is None and B.is_host(g):
            return self._encode_in_place(g, meta, st, noise, m, nesterov, plain)
        if nesterov:
            u = (st.u + g) * m
            vacc = u + g if plain else st.v + u + g
        else:
            u = st.u * m + g
            vacc = u if plain else st.v + u
        enc = super()._encode(vacc, meta, st, noise, flag)
        finite = B.isfinite(flag) if flag is not None else True
        old_v, old_u = st.v, st.u
        if plain:  # momentum only: nothing is kept back
            st.u = B.cond(finite, lambda: u, lambda: old_u)
            return enc
        sent = self._decode_own(enc)
        st.v = B.cond(finite, lambda: vacc - sent, lambda: old_v)
        if self.params["masking"]:
            u = B.where(self._hit(enc), 0.0, u)
        st.u = B.cond(finite, lambda: u, lambda: old_u)
        return enc

    def clip_factor(self, norm):
        """What local gradient clipping multiplies ``g`` by: ``min(1, clip_norm / (sqrt(N)
        * max(norm, 1e-30)))`` (float32, 0-d) for its float32 norm."""
        B = self.B
        limit = float(self.params["clip_norm"]) / math.sqrt(self.world_size)
        return B.minimum(B.scalar(1.0, like=norm), B.div(limit, B.maximum(norm, 1e-30)))

    def _hit(self, enc):
        """Where ``enc`` sent a value (bool, dense): momentum factor masking's mask."""
        B = self.B
        return B.scatter_add(enc.meta.numel, enc.ctx.indices, B.cast(enc.ctx.valid, "float32")) > 0

    def _encode_device(self, g, meta, st, noise) -> Encoded:
        """Device memory: the momentum, ``|v|`` and the kept state as the backend's passes
        (:class:`MomentumPasses`) where it has them -- one pass for the momentum (two with
        clipping), the sent values subtracted and ``u`` masked at the ``k`` sent indices
        only, the old state copied back after a non-finite step -- the chain's bits, no host
        read; else the chain (:meth:`_encode`)."""
        passes = self.B.fused_encoder(MOMENTUM_PASSES, 1, like=g)
        done = None if passes is None else self._device_step(passes, g, meta, st, noise)
        return super()._encode_device(g, meta, st, noise) if done is None else done

    def _device_step(self, passes, g, meta, st, noise):
        B = self.B
        plain = self.momentum_only(meta, st.step)
        factor_of = (lambda ss: self.clip_factor(B.cast(B.sqrt(ss), "float32"))) \
            if float(self.params["clip_norm"]) > 0 else None
        new = passes.momentum(g, st.u, None if plain else st.v, float(self.params["momentum"]),
                              bool(self.params["nesterov"]), factor_of)
        if new is None:
            return None
        u, vacc, mag, bad = new  # g's NaN/Inf read as 0 (zero_nonfinite), counted in bad
        flag = nan_flag(B, B.reshape(bad, ()) == 0, g)
        enc = super()._encode(vacc, meta, st, noise, flag, known=(mag, passes))
        if plain:  # momentum only: nothing is kept back
            st.u, _ = passes.settle(u, None, st.u, None, bad)
            return enc
        masking, sent = bool(self.params["masking"]), None
        if self._codec is None:  # a value sent at each valid slot: v -= it there alone
            sent = (enc.ctx.indices, enc.ctx.valid, enc.ctx.sent)
        else:  # the quantizer's values, with its zeros' decodes in unused slots: the chain's
            vacc = vacc - self._decode_own(enc)
            u = B.where(self._hit(enc), 0.0, u) if masking else u
        st.u, st.v = passes.settle(u, vacc, st.u, st.v, bad, sent, masking)
        return enc

    def _encode_in_place(self, g, meta, st, noise, m, nesterov, plain) -> Encoded:
        """Host memory, finite input: the same arithmetic on the state buffers in place."""
        B = self.B
        u, vacc = st.u, st.v
        if nesterov:
            B.iadd(u, g)
            B.imul(u, m)
            vacc = u + g if plain else B.iadd(B.iadd(vacc, u), g)
        else:
            B.imul(u, m)
            B.iadd(u, g)
            vacc = u if plain else B.iadd(vacc, u)
        enc = super()._encode(vacc, meta, st, noise, None)
        if plain:
            return enc
        idx = enc.ctx.indices
        B.index_add(vacc, idx, -enc.ctx.sent)  # v keeps what was not sent
        if self.params["masking"]:  # u[idx] = 0 where a value was sent (x + -x = +0)
            B.index_add(u, idx, -B.where(enc.ctx.valid, B.gather(u, idx), 0.0))
        return enc
