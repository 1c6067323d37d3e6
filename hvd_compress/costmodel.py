"""A cost model of one training step: when does compression pay?

The alpha-beta model of collectives (Hockney 1994; ring algorithms as in
Thakur, Rabenseifner and Gropp, IJHPCA 2005), for a payload of ``S`` bytes per
worker, ``p`` workers, link rate ``B`` bits/s and per-message latency ``alpha``::

    ring allreduce   2(p-1)/p * S * 8/B  +  2(p-1) * alpha
    ring allgather   (p-1)   * S * 8/B  +   (p-1) * alpha

and a step is ``compute + encode + decode(p) + comm(p, B)`` where decoding an
allgather grows with the number of payloads.  :func:`fit_link` recovers
``alpha`` and the link efficiency ``eta`` (the share of the nominal rate the
collectives reach, which also absorbs the overlap of communication with the
backward pass) from measured communication times by least squares;
:class:`StepModel` combines them with each compressor's measured compute,
encode/decode time and bytes to predict step times at other bandwidths and
worker counts, and :func:`crossover` finds the bandwidth below which a
compressor beats sending gradients uncompressed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALLREDUCE, ALLGATHER = "allreduce", "allgather"


def wire_bytes(collective: str, p: int, nbytes: float) -> float:
    """Bytes one worker puts on its link for one collective of an ``nbytes`` payload."""
    if p <= 1:
        return 0.0
    if collective == ALLREDUCE:
        return 2.0 * (p - 1) / p * nbytes
    if collective == ALLGATHER:
        return (p - 1) * float(nbytes)
    raise ValueError(f"unknown collective {collective!r}")


def hops(collective: str, p: int) -> int:
    """Latency-bound message steps of one ring collective."""
    if p <= 1:
        return 0
    return 2 * (p - 1) if collective == ALLREDUCE else p - 1


@dataclass(frozen=True)
class Link:
    """``alpha_s`` per message step; ``efficiency`` of the nominal bandwidth reached."""

    alpha_s: float
    efficiency: float = 1.0

    def comm_s(self, collective: str, p: int, nbytes: float, bandwidth_bps: float,
               messages: float = 1.0) -> float:
        """Seconds for ``messages`` collectives per step moving ``nbytes`` in all."""
        bits = 8.0 * wire_bytes(collective, p, nbytes)
        return messages * hops(collective, p) * self.alpha_s + bits / (self.efficiency * bandwidth_bps)


@dataclass(frozen=True)
class Sample:
    """One measured step's communication: what was sent and how long it took."""

    collective: str
    p: int
    nbytes: float            # payload bytes per worker per step
    bandwidth_bps: float
    messages: float          # collectives per step
    comm_s: float            # measured


def fit_link(samples: list[Sample]) -> Link:
    """Least-squares ``alpha`` and efficiency from measured communication times.

    ``comm = alpha * messages * hops + (1/eta) * bits/B`` is linear in
    ``(alpha, 1/eta)``.  Residuals are weighted by 1/comm (timing noise is
    relative: a 1 ms message and a 1 s transfer count alike); both parameters
    are kept non-negative (a one-parameter fit when the two-parameter one
    leaves the feasible region)."""
    rows = [(s.messages * hops(s.collective, s.p),
             8.0 * wire_bytes(s.collective, s.p, s.nbytes) / s.bandwidth_bps, s.comm_s)
            for s in samples if s.p > 1]
    if not rows:
        raise ValueError("fit_link: no sample with more than one worker")
    w = np.array([1.0 / max(r[2], 1e-9) for r in rows], dtype=np.float64)
    a = np.array([[r[0], r[1]] for r in rows], dtype=np.float64) * w[:, None]
    y = np.array([r[2] for r in rows], dtype=np.float64) * w
    alpha, inv_eta = -1.0, -1.0
    if len(rows) >= 2 and np.linalg.matrix_rank(a) == 2:
        (alpha, inv_eta), *_ = np.linalg.lstsq(a, y, rcond=None)
    if alpha < 0 or inv_eta <= 0:  # infeasible or underdetermined: alpha = 0, bandwidth only
        col = a[:, 1]
        alpha = 0.0
        inv_eta = max(float(col @ y / (col @ col)) if col @ col > 0 else 1.0, 1e-9)
    return Link(alpha_s=float(alpha), efficiency=float(1.0 / inv_eta))


def fit_links(samples: list[Sample]) -> dict[str, Link]:
    """One :class:`Link` per collective (allreduce and allgather are different
    algorithms in Gloo and MPI and reach different shares of a link), each fitted
    to its own samples when it has two or more, else the joint fit."""
    joint = fit_link(samples)
    out = {}
    for coll in (ALLREDUCE, ALLGATHER):
        mine = [s for s in samples if s.collective == coll and s.p > 1]
        out[coll] = fit_link(mine) if len(mine) >= 2 else joint
    return out


@dataclass
class Profile:
    """What one compressor costs a worker per step, measured (milliseconds, bytes)."""

    compression: str
    collective: str
    compute_ms: float
    encode_ms: float
    decode_ms: float          # at ``measured_p`` workers
    nbytes: float             # payload bytes one worker sends per step
    messages: float = 1.0     # collectives per step
    measured_p: int = 1
    images_per_step: float = 1.0  # per worker

    def decode_at(self, p: int) -> float:
        """Allgather decodes one payload per worker; an allreduce's one sum."""
        if self.collective == ALLGATHER and self.measured_p > 0:
            return self.decode_ms * max(1, p) / max(1, self.measured_p)
        return self.decode_ms


class StepModel:
    """Predicted step time = compute + encode + decode(p) + comm(p, B).

    ``link``: one :class:`Link` for every collective, or a dict by collective."""

    def __init__(self, link, profiles: dict[str, Profile]):
        self.links = link if isinstance(link, dict) else {ALLREDUCE: link, ALLGATHER: link}
        self.profiles = profiles

    def step_ms(self, compression: str, p: int, bandwidth_bps: float) -> float:
        f = self.profiles[compression]
        comm = self.links[f.collective].comm_s(f.collective, p, f.nbytes, bandwidth_bps, f.messages) * 1e3
        return f.compute_ms + f.encode_ms + f.decode_at(p) + comm

    def images_per_sec(self, compression: str, p: int, bandwidth_bps: float) -> float:
        f = self.profiles[compression]
        return p * f.images_per_step / (self.step_ms(compression, p, bandwidth_bps) / 1e3)


def crossover(model: StepModel, compression: str, p: int, baseline: str = "none",
              lo_bps: float = 1e6, hi_bps: float = 1e12) -> tuple[str, float | None]:
    """Where ``compression`` stops beating ``baseline`` as bandwidth grows.

    Returns ``("below", B)`` (faster below B bits/s), ``("always", None)``,
    ``("never", None)`` or ``("above", B)`` (the rare opposite ordering)."""
    def gain(bps):  # > 0: compression is faster
        return model.step_ms(baseline, p, bps) - model.step_ms(compression, p, bps)
    g_lo, g_hi = gain(lo_bps), gain(hi_bps)
    if g_lo > 0 and g_hi > 0:
        return "always", None
    if g_lo <= 0 and g_hi <= 0:
        return "never", None
    a, b = math.log(lo_bps), math.log(hi_bps)
    for _ in range(100):
        m = 0.5 * (a + b)
        if (gain(math.exp(m)) > 0) == (g_lo > 0):
            a = m
        else:
            b = m
    return ("below" if g_lo > 0 else "above"), math.exp(0.5 * (a + b))
