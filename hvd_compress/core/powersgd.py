"""PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019): rank-r power iteration
with warm start and error feedback.

A tensor is seen as the matrix ``M`` its framework's layout gives it (plus this
rank's residual): ``shape[0]`` rows and ``numel/shape[0]`` columns in PyTorch's,
``numel/shape[-1]`` rows and ``shape[-1]`` columns in TensorFlow's
(:mod:`.layout`).  One step takes two allreduce rounds:

1. send ``P = M Q`` (rows x r) -- ``Q`` (cols x r) is shared by all ranks;
2. ``P_hat = orthonormalize(sum P)``; send ``Q_w = M^T P_hat`` (cols x r);
3. the aggregate is ``P_hat (sum Q_w)^T``; this rank's residual is
   ``M - P_hat Q_w^T`` (what its own contribution lost), and the next step
   starts from ``Q = mean Q_w`` (warm start) -- all ranks agree on it.

Both payloads are float32 and add up, so both rounds are allreduces, and the
wire carries ``(rows + cols) * r`` floats per matrix.  Tensors for which that is
not smaller than ``rows * cols`` (vectors, small matrices) are sent dense in one
allreduce, as PyTorch's PowerSGD hook does.  The first ``Q`` is drawn from a
normal distribution seeded by (seed, tensor name), identically on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from . import layout as layouts
from .base import Compressor, Encoded, nan_flag, zero_nonfinite
from .sampling import hash_stream, stream_keys
from .state import TensorState, shared

PURPOSE_Q = 3


@dataclass
class Rounds:
    """PowerSGD's encoding context: ``dense`` (sent as it is, one round), or round 0's
    matrix ``m`` with its finiteness (``finite``, ``flag``), then round 1's ``p_hat``."""

    dense: bool = False
    m: Any = None
    finite: Any = None
    flag: Any = None
    p_hat: Any = None


def matrix_shape(meta, layout: str = layouts.OUT_FIRST) -> tuple:
    """``(rows, cols)`` of the matrix PowerSGD sees for ``meta`` in ``layout``."""
    return layouts.matrix_shape(meta.shape, layout)


@dataclass(eq=False)
class PowerSGDState(TensorState):
    """PowerSGD's ``q`` (cols x r), the same on every rank: the warm start."""

    q: Any = shared()


class PowerSGD(Compressor):
    """PowerSGD; see the module docstring."""

    name = "powersgd"
    summable = True
    chained_rounds = True
    State = PowerSGDState

    def __init__(self, params=None, backend=None, rank=0, world_size=1):
        from .backend import NUMPY
        super().__init__(params, backend or NUMPY, rank, world_size)
        self.r = int(self.params["rank"])

    def matrix_shape(self, meta) -> tuple:
        """``(rows, cols)`` in the layout of this compressor's backend."""
        return matrix_shape(meta, layouts.layout_of(self.B))

    def compressed(self, meta) -> bool:
        rows, cols = self.matrix_shape(meta)
        return len(meta.shape) >= 2 and (rows + cols) * self.r < rows * cols

    def rounds(self, meta) -> int:
        return 2 if self.compressed(meta) else 1

    def payload_nbytes(self, meta) -> int:
        rows, cols = self.matrix_shape(meta)
        return 4 * ((rows + cols) * self.r if self.compressed(meta) else meta.numel)

    def fused(self, like):
        """The backend's kernels for the element-wise passes on ``like``'s device, or None
        (the chain of array operations): ``finite_matrix(v, residual) -> (m, finite)`` (the
        sum, its finiteness, ``zero_nonfinite``) and ``keep_finite(new, old, finite) ->
        residual``, each of which may answer None (the chain) -- asked of backends that
        have the hook (torch: Triton on CUDA tensors, :mod:`hvd_compress.accel`)."""
        hook = getattr(self.B, "fused_powersgd", None)
        return None if hook is None else hook(like)

    def _gaussian(self, meta, step, like):
        """cols x r standard normals from the shared hash stream (Box-Muller)."""
        B = self.B
        _, cols = self.matrix_shape(meta)
        n = cols * self.r
        key0, key1 = stream_keys(B, int(self.params["seed"]), meta.name, step,
                                 PURPOSE_Q, like=like)
        h = hash_stream(B, key0, key1, 2 * n, like=like)
        u = (B.cast(B.shift_right(h, 8), "float32") + 0.5) * (1.0 / (1 << 24))
        u1, u2 = u[:n], u[n:]
        z = B.sqrt(-2.0 * B.log(u1)) * B.cos((2.0 * math.pi) * u2)
        return B.reshape(z, (cols, self.r))

    def _new_state(self, meta, like):
        st = super()._new_state(meta, like)
        if self.compressed(meta):
            st.q = self._gaussian(meta, 0, like)
        return st

    def encode(self, x, name="", noise=None) -> Encoded:
        meta = self.meta_for(x, name)
        B = self.B
        v = B.cast(B.reshape(x, (-1,)), "float32")
        if not self.compressed(meta):
            return Encoded(v, meta, self.payload_nbytes(meta), ctx=Rounds(dense=True))
        st = self.state(meta, like=v)
        residual = st.residual if self.ef else None
        fused = self.fused(v)
        done = None if fused is None else fused.finite_matrix(v, residual)
        if done is None:
            v = v if residual is None else v + residual
            finite = B.all_finite(v)
            done = zero_nonfinite(B, v, finite), finite
        m, finite = done
        flag = nan_flag(B, finite, v)
        rows, cols = self.matrix_shape(meta)
        m = B.reshape(m, (rows, cols))
        q = st.q
        if not self.params["warm_start"]:
            q = self._gaussian(meta, st.step, v)
        p = B.matmul(m, q) * flag
        return Encoded(p, meta, 4 * rows * self.r, round=0,
                       ctx=Rounds(m=m, finite=finite, flag=flag))

    def next_round(self, enc: Encoded, reduced) -> Encoded:
        B = self.B
        meta = enc.meta
        st = self.states[meta.name]
        p_hat = B.orthonormalize(reduced)
        q_w = B.matmul(enc.ctx.m, p_hat, transpose_a=True) * enc.ctx.flag
        if self.ef:  # what this rank's contribution lost; kept unless M or the factors were not finite
            new = B.reshape(B.subtract_product(enc.ctx.m, p_hat, q_w), (-1,))
            old, fused = st.residual, self.fused(new)
            kept = None if fused is None else fused.keep_finite(new, old, enc.ctx.finite)
            st.residual = kept if kept is not None else B.cond(
                B.all_finite(new) & enc.ctx.finite, lambda: new, lambda: old)
        _, cols = self.matrix_shape(meta)
        return Encoded(q_w, meta, 4 * cols * self.r, round=1, ctx=Rounds(p_hat=p_hat))

    def aggregate(self, received, enc: Encoded, out=None):
        B = self.B
        meta = enc.meta
        if enc.ctx.dense:
            return self._finish(received, meta, out)
        st = self.states[meta.name]
        total = B.matmul(enc.ctx.p_hat, received, transpose_b=True)
        q_next = received * (1.0 / self.world_size)
        st.q = B.where(B.all_finite(q_next), q_next, st.q)
        st.step = st.step + 1
        return self._finish(B.reshape(total, (-1,)), meta, out)

    def decode(self, payload, meta, ctx=None, out=None):
        raise NotImplementedError("powersgd: decoding needs both rounds; use aggregate()")
