"""Deep Gradient Compression (Lin, Han, Mao, Wang & Dally, ICLR 2018).

Per tensor, each step, on every rank:

1. *local gradient clipping* (``clip_norm > 0``): ``g *= min(1, clip_norm /
   (sqrt(N) * ||g||))`` with N ranks, so the sum of N clipped gradients obeys
   the global clipping threshold;
2. *momentum correction*: ``u = m*u + g; v = v + u`` (Nesterov: ``u = m*(u + g);
   v = v + u + g``) -- momentum is applied here, before sparsification, so pair
   DGC with a plain SGD step (no optimizer momentum);
3. *sampled threshold*: the threshold is the k_s-th largest ``|v|`` of a
   sample of ``sample_ratio * n`` positions (at least 256, shared by every rank
   through :mod:`~hvd_compress.core.sampling`), then a *correction loop* of
   four rounds multiplies it by 1.3 while more than 1.3k values pass and by 0.8
   while fewer than 0.8k pass;
4. the first k positions (in index order) with ``|v| >= threshold`` are sent,
   with ``k = ceil(density * n)``, as (index, value) pairs -- a fixed-size
   payload; unused slots carry index 0, value 0;
5. *momentum factor masking*: ``v`` keeps what was not sent (``v -= sent``) and
   ``u`` is zeroed where values were sent.

*Warm-up*: for the first ``warmup_epochs`` epochs the density is
``max(ratio, 0.25**(epoch+1))`` -- sparsity 75%, 93.75%, 98.4375%, 99.6% --
then ``ratio`` (0.1% by default, sparsity 99.9%).  The epoch is
``step // steps_per_epoch`` when ``steps_per_epoch`` is given, else what
:meth:`DGC.set_epoch` last set (0 at first).
"""

from __future__ import annotations

import math

import numpy as np

from .base import Encoded
from .quantizers import _norm64
from .sampling import stratified_indices, stream_keys
from .sparsifiers import PURPOSE_DGC_SAMPLE, Sparsifier, count_for

ADAPT_ROUNDS = 4
UPPER, LOWER = 1.3, 0.8
MIN_SAMPLES = 256


def warmup_density(ratio: float, epoch: int, warmup_epochs: int) -> float:
    """Fraction of elements sent at ``epoch`` (DGC's exponential warm-up)."""
    if epoch < warmup_epochs:
        return max(ratio, 0.25 ** (epoch + 1))
    return ratio


class DGC(Sparsifier):
    """Deep Gradient Compression; see the module docstring."""

    name = "dgc"

    def __init__(self, params=None, backend=None, rank=0, world_size=1, codec=None):
        params = dict(params or {})
        params["ef"] = False  # DGC keeps its own memory (u, v) instead of a residual
        super().__init__(params, backend, rank, world_size, codec)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch for the warm-up schedule (when ``steps_per_epoch`` is 0)."""
        if epoch < 0:
            raise ValueError(f"dgc: epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)

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
        return warmup_density(float(self.params["ratio"]), self.current_epoch(step),
                              int(self.params["warmup_epochs"]))

    def k_for(self, meta, ctx=None) -> int:
        if ctx is not None:
            return ctx.k
        st = self.states.get(meta.name)
        step = st["step"] if st else 0
        return count_for(self.density(step), meta.numel)

    def _init_state(self, meta, like):
        z = self.B.zeros((meta.numel,), "float32", like=like)
        return {"u": z, "v": self.B.copy(z)}

    def threshold(self, mag, meta, step):
        """The sampled threshold on magnitudes ``mag``, after the correction loop (0-d)."""
        B = self.B
        n, k = meta.numel, self.k_for(meta)
        s = min(n, max(math.ceil(float(self.params["sample_ratio"]) * n), MIN_SAMPLES))
        if s < n:
            key0, key1 = stream_keys(B, int(self.params["seed"]), meta.name, step,
                                     PURPOSE_DGC_SAMPLE, like=mag)
            pos, _ = stratified_indices(B, n, s, key0, key1, like=mag)
            sample = B.gather(mag, pos)
        else:
            sample = mag
        ks = max(1, min(s, math.ceil(k * s / n)))
        thr = B.kth_largest(sample, ks)
        host = B.is_host(mag)
        for _ in range(ADAPT_ROUNDS):
            cnt = B.count_nonzero(mag >= thr)
            if host:  # stop as soon as the count is in bounds (the device walk then idles)
                cnt = int(cnt)
                if LOWER * k <= cnt <= UPPER * k:
                    break
                thr = thr * UPPER if cnt > UPPER * k else thr * LOWER
            else:  # a fixed number of rounds: no host round-trip
                cnt = B.cast(cnt, "float64")
                thr = B.where(cnt > UPPER * k, thr * UPPER,
                              B.where(cnt < LOWER * k, thr * LOWER, thr))
        return thr

    def _select(self, vacc, meta, st):
        mag = self.B.abs(vacc)
        thr = self.threshold(mag, meta, st["step"])
        return self.B.compact(mag >= thr, self.k_for(meta)), None

    def _encode(self, g, meta, st, noise, flag) -> Encoded:
        B = self.B
        m = float(self.params["momentum"])
        clip = float(self.params["clip_norm"])
        if clip > 0:
            norm = _norm64(B, g)
            limit = clip / math.sqrt(self.world_size)
            g = g * B.minimum(B.scalar(1.0, like=g), B.div(limit, B.maximum(norm, 1e-30)))
        nesterov = bool(self.params["nesterov"])
        if flag is None and B.is_host(g):
            return self._encode_in_place(g, meta, st, noise, m, nesterov)
        if nesterov:
            u = (st["u"] + g) * m
            vacc = st["v"] + u + g
        else:
            u = st["u"] * m + g
            vacc = st["v"] + u
        enc = super()._encode(vacc, meta, st, noise, flag)
        sent = self._decode_own(enc)
        hit = B.scatter_add(meta.numel, enc.ctx.indices, B.cast(enc.ctx.valid, "float32")) > 0
        finite = B.isfinite(flag) if flag is not None else True
        old_v, old_u = st["v"], st["u"]
        st["v"] = B.cond(finite, lambda: vacc - sent, lambda: old_v)
        st["u"] = B.cond(finite, lambda: B.where(hit, 0.0, u), lambda: old_u)
        return enc

    def _encode_in_place(self, g, meta, st, noise, m, nesterov) -> Encoded:
        """Host memory, finite input: the same arithmetic on the state buffers in place."""
        B = self.B
        u, vacc = st["u"], st["v"]
        if nesterov:
            B.iadd(u, g)
            B.imul(u, m)
            B.iadd(vacc, u)
            B.iadd(vacc, g)
        else:
            B.imul(u, m)
            B.iadd(u, g)
            B.iadd(vacc, u)
        enc = super()._encode(vacc, meta, st, noise, None)
        idx = enc.ctx.indices
        B.index_add(vacc, idx, -enc.ctx.sent)  # v keeps what was not sent
        # momentum factor masking: u[idx] = 0 where a value was sent (x + -x = +0)
        B.index_add(u, idx, -B.where(enc.ctx.valid, B.gather(u, idx), 0.0))
        return enc
