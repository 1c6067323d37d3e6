"""A cost model of one training step: when does compression pay?

The alpha-beta model of collectives (Hockney 1994; ring algorithms as in
Thakur, Rabenseifner and Gropp, IJHPCA 2005), for a payload of ``S`` bytes per
worker, ``p`` workers, link rate ``B`` bits/s and per-message latency ``alpha``::

    ring allreduce   2(p-1)/p * S * 8/B  +  2(p-1) * alpha
    ring allgather   (p-1)   * S * 8/B  +   (p-1) * alpha

and a step is ``compute + encode + decode(p) + wait(p, B)`` where decoding an
allgather grows with the number of payloads and ``wait = max(0, offset +
comm)`` is the communication a step waits for.  :func:`fit_model` recovers
``alpha``, the link efficiency ``eta`` (the share of the nominal rate the
collectives reach) and each compressor's offset (reduction arithmetic and
coordination, less what hides behind the backward pass) from measured
communication times by weighted least squares; :class:`StepModel` combines
them with each compressor's measured compute, encode/decode time and bytes to
predict step times at other bandwidths and worker counts, and
:func:`crossover` finds the bandwidth below which a compressor beats sending
gradients uncompressed.

Nodes (``per_node`` workers sharing one link to the other nodes).  Flat, a ring
crosses each node's link once, so the formulas above hold with ``B`` the node's
link.  The hierarchical exchange (:mod:`hvd_compress.core.hierarchy`; nodes of
``L``, ``N = p / L``) puts on the node's link its ``L`` workers' collectives
among the ``N`` nodes, each of a shard's payload ``s``::

    hierarchical allgather     L * (N-1) * s * 8/B        +   (N-1) * alpha
    hierarchical integer sum   L * 2(N-1)/N * s * 8/B     + 2(N-1) * alpha

plus the dense reduce-scatter and allgather inside the node, ``2 (L-1)/L`` of the
gradient per worker at the node's internal rate (or, where the model was fitted,
a fitted cost per bit, :attr:`Link.local_s_per_bit`).  A worker encodes and
decodes a shard (``1/L`` of each tensor) and decodes ``N`` payloads, not ``p``;
integer sums pay lanes as wide as ``p`` needs (:class:`Profile`).

The two-phase exchange (the compressed allreduce of 1-bit Adam, Ok-Topk and gTop-k:
an alltoall of compressed chunks to their owners, who sum and re-compress them, then
an allgather of the owners' chunks) sends and receives about ``2 (p-1)/p * S`` a worker
whatever ``p``, in ``2 (p-1)`` message steps, and decodes about twice a tensor rather
than ``p`` payloads; flat, a node's link carries its ``L`` workers' chunks for the other
nodes besides one ring.  Hierarchical, it runs among the nodes in place of the allgather.
Every byte, step and value counted here is :mod:`hvd_compress.core.exchangecost`'s
(in fractions of a tensor: ``exact=False``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..core import exchangecost as xc

ALLREDUCE, ALLGATHER, TWO_PHASE = xc.ALLREDUCE, xc.ALLGATHER, xc.TWO_PHASE
#: the collectives a link is fitted for: two-phase samples share the allgather's (both move
#: compressed payloads, by Horovod's allgather and alltoall)
LINK_OF = {ALLREDUCE: ALLREDUCE, ALLGATHER: ALLGATHER, TWO_PHASE: ALLGATHER}
#: the share of the nominal rate a fitted link may reach (a prior: with one capped
#: rate, a slow link and a transfer hidden behind compute look alike)
ETA_RANGE = (0.5, 2.0)


def exchange_of(collective: str, hierarchical: bool = False) -> str:
    """The :mod:`~hvd_compress.core.exchangecost` exchange of a collective (``allreduce``,
    ``allgather`` or ``two-phase``), hierarchical or not."""
    if collective not in LINK_OF:
        raise ValueError(f"unknown collective {collective!r}")
    if not hierarchical:
        return collective
    return xc.HIERARCHICAL_TWO_PHASE if collective == TWO_PHASE else xc.HIERARCHICAL


def _traffic(collective: str, p: int, per_node: int = 1, hierarchical: bool = False,
             payload: float = 1.0) -> xc.Traffic:
    """One exchange of a whole tensor in fractions (``numel`` 1) whose payload is
    ``payload`` bytes; a hierarchical exchange where there are two nodes of two or more."""
    hier = hierarchical and per_node > 1 and p // per_node > 1 and p % per_node == 0
    return xc.traffic(exchange_of(collective, hier), 1.0, p, per_node if per_node > 1 else 1,
                      lambda m: payload * m, summable=collective == ALLREDUCE, exact=False)


def wire_bytes(collective: str, p: int, nbytes: float, per_node: int = 1,
               hierarchical: bool = False) -> float:
    """Bytes on the busiest link for one exchange of an ``nbytes`` payload per worker.

    Flat: a node's link to the others (rings cross it once; the two-phase exchange's
    alltoall carries its ``per_node`` workers' chunks for the other nodes); one node, or
    every worker its own link: what a worker sends.  ``hierarchical`` (nodes of
    ``per_node``): the node's link carries its ``per_node`` workers' exchanges among the
    ``p / per_node`` nodes, each of a shard's payload ``nbytes``."""
    hier = hierarchical and per_node > 1 and p // per_node > 1
    return float(_traffic(collective, p, per_node, hier, nbytes * (per_node if hier else 1)).wire)


def hops(collective: str, p: int, per_node: int = 1, hierarchical: bool = False) -> int:
    """Latency-bound message steps of one exchange (hierarchical: among the nodes): a ring
    allreduce ``2 (p-1)``, an allgather ``p - 1``, two-phase ``2 (p-1)`` (its alltoall and
    its allgather)."""
    return int(_traffic(collective, p, per_node, hierarchical).steps)


@dataclass(frozen=True)
class Link:
    """``alpha_s`` per message step; ``efficiency`` of the nominal bandwidth reached;
    ``local_s_per_bit``: what a bit of the hierarchical exchange's dense traffic inside a
    node cost where the model was fitted (its link and the node's sums; 0: not fitted)."""

    alpha_s: float
    efficiency: float = 1.0
    local_s_per_bit: float = 0.0

    def comm_s(self, collective: str, p: int, nbytes: float, bandwidth_bps: float,
               messages: float = 1.0, per_node: int = 1, hierarchical: bool = False,
               local_bytes: float = 0.0, local_bps: float | None = None) -> float:
        """Seconds for ``messages`` collectives per step moving ``nbytes`` in all, and the
        ``local_bytes`` inside the node: at ``local_bps`` (nominal, as efficient as the
        link between nodes), or as fitted (``local_bps=None``)."""
        bits = 8.0 * wire_bytes(collective, p, nbytes, per_node, hierarchical)
        t = messages * hops(collective, p, per_node, hierarchical) * self.alpha_s + \
            bits / (self.efficiency * bandwidth_bps)
        if local_bytes:
            t += 8.0 * local_bytes * (self.local_s_per_bit if local_bps is None
                                      else 1.0 / (self.efficiency * local_bps))
        return t


@dataclass(frozen=True)
class Sample:
    """One measured step's communication: what was sent and how long it took."""

    collective: str
    p: int
    nbytes: float            # payload bytes per worker per step
    bandwidth_bps: float
    messages: float          # collectives per step
    comm_s: float            # measured
    group: str = ""          # the compressor: samples of one group share an offset
    step_s: float = 0.0      # the measured step, to weigh residuals (0: comm_s)
    per_node: int = 1        # workers per node
    hierarchical: bool = False  # the hierarchical exchange (nbytes: a shard's payload)
    local_bytes: float = 0.0    # its dense bytes inside the node per worker per step


def fit_model(samples: list[Sample], alpha_s: float | None = None,
              ) -> tuple[dict[str, Link], dict[str, float]]:
    """One :class:`Link` per collective and one offset per group (compressor).

    The communication a step waits for is ``max(0, offset_c + transfer(p, B))``
    with ``transfer`` the alpha-beta time above.  ``offset_c`` takes up what a
    compressor's collective costs besides the link -- the reduction arithmetic
    (fp16 sums are slow on a CPU) and coordination, less the part of the
    transfer hidden behind the backward pass (negative offsets: small payloads
    vanish entirely).  Uncapped runs (``bandwidth_bps = inf``) pin the offsets,
    capped runs the link.  An offset is never below minus the rest of the step
    (a transfer can hide behind no more than the step's other work).  Residuals
    are weighted by the measured step time (what the model predicts is a step).
    Fitted by a grid over ``alpha`` and ``eta`` (0.5 to 2 times the nominal rate)
    per collective, the offsets solved per grid point.  With one worker count,
    ``alpha * hops`` is a constant the offsets absorb: pass ``alpha_s`` to fix it
    instead of fitting it.  Hierarchical samples (runs in nodes) add their dense bytes
    inside the node at a fitted cost per bit (:attr:`Link.local_s_per_bit`), the same
    compressor's flat and hierarchical runs sharing its offset.  Two-phase samples are
    fitted with the allgather's (one link for the compressed payloads; give them groups of
    their own: a group's offset is one collective's).  A collective without samples gets
    the other's link.
    """
    links, offsets = {}, {}
    for coll in (ALLREDUCE, ALLGATHER):
        mine = [s for s in samples if LINK_OF[s.collective] == coll and s.p > 1]
        if not mine:
            continue
        links[coll], off = _fit_collective(mine, alpha_s)
        shared = set(off) & set(offsets)
        if shared:
            raise ValueError(f"fit_model: group(s) {sorted(shared)} in samples of both links")
        offsets.update(off)
    if not links:
        raise ValueError("fit_model: no sample with more than one worker")
    for coll in (ALLREDUCE, ALLGATHER):
        links.setdefault(coll, next(iter(links.values())))
    links[TWO_PHASE] = links[ALLGATHER]
    return links, offsets


def _fit_collective(samples: list[Sample], alpha_s=None) -> tuple[Link, dict[str, float]]:
    groups = sorted({s.group for s in samples})
    gi = np.array([groups.index(s.group) for s in samples])
    lat = np.array([s.messages * hops(s.collective, s.p, s.per_node, s.hierarchical)
                    for s in samples], dtype=np.float64)
    bits = np.array([8.0 * wire_bytes(s.collective, s.p, s.nbytes, s.per_node, s.hierarchical)
                     / s.bandwidth_bps for s in samples], dtype=np.float64)
    loc = np.array([8.0 * s.local_bytes for s in samples], dtype=np.float64)
    y = np.array([s.comm_s for s in samples], dtype=np.float64)
    steps = np.array([s.step_s or s.comm_s for s in samples], dtype=np.float64)
    w2 = 1.0 / np.maximum(steps, 1e-6) ** 2
    floor = np.array([-max(0.0, min(steps[gi == g] - y[gi == g])) for g in range(len(groups))])
    capped = bool((bits > 0).any())
    local = bool((loc > 0).any())

    def offsets(alpha, eta, theta):
        """Best offsets for one link: the best of a grid, then least squares over the
        samples each leaves above zero.  Returns (offsets, weighted squared error)."""
        t = alpha * lat + bits / eta + theta * loc
        cands = np.linspace(-float(t.max()) - 1e-3, float(y.max()) + 1e-3, 401)
        err = (np.maximum(0.0, cands[:, None] + t[None, :]) - y[None, :]) ** 2 * w2[None, :]
        per_group = np.zeros((len(cands), len(groups)))
        np.add.at(per_group.T, gi, err.T)
        per_group[cands[:, None] < floor[None, :]] = np.inf
        c = cands[per_group.argmin(axis=0)]
        for g in range(len(groups)):
            on = (gi == g) & (c[g] + t > 0)
            if on.any():
                c[g] = max(float(np.sum(w2[on] * (y[on] - t[on])) / np.sum(w2[on])), floor[g])
        return c, float(np.sum(w2 * (np.maximum(0.0, c[gi] + t) - y) ** 2))

    def search(theta):
        """(error, alpha, eta) for a local cost ``theta``: for each alpha of a coarse grid
        the best eta (a grid, then zooming in), then both zoomed in together around the
        best pair (log scales; alpha = 0 kept apart)."""
        def zoom(best, grid, rounds=24):
            step_a, step_e = 2.0, 1.06
            for _ in range(rounds):
                grid_a, grid_e = grid(best[1], best[2], step_a, step_e)
                moved = min([best] + [(offsets(a, e, theta)[1], a, e) for a in grid_a
                                      for e in grid_e], key=lambda r: r[0])
                if moved[1:] == best[1:]:  # the best is inside: look closer
                    step_a, step_e = step_a ** 0.5, step_e ** 0.5
                best = moved
            return best

        def around_eta(a0, e0, step_a, step_e):
            return [a0], ([e0] if not capped else np.clip(e0 * step_e ** np.linspace(-1, 1, 7),
                                                          *ETA_RANGE))

        def around_both(a0, e0, step_a, step_e):
            grid_a = [a0] if alpha_s is not None or a0 == 0.0 else a0 * step_a ** np.linspace(-1, 1, 7)
            return grid_a, around_eta(a0, e0, step_a, step_e)[1]

        alphas = np.concatenate([[0.0], np.geomspace(1e-6, 0.2, 25)]) if alpha_s is None \
            else np.array([float(alpha_s)])
        etas = np.geomspace(ETA_RANGE[0], ETA_RANGE[1], 25) if capped else np.array([1.0])
        per_alpha = [zoom(min(((offsets(a, e, theta)[1], a, e) for e in etas),
                              key=lambda r: r[0]), around_eta, 8) for a in alphas]
        return zoom(min(per_alpha, key=lambda r: r[0]), around_both)

    # the local cost (seconds per bit inside a node, 1 Mbit/s to 10 Tbit/s), alternating
    # with the link: the best theta for the link found without it (a log grid, then
    # zooming in), the link again for that theta, theta again; the polish below then
    # solves all of them together
    def best_theta(alpha, eta):
        tried = {th: offsets(alpha, eta, th)[1]
                 for th in np.concatenate([[0.0], np.geomspace(1e-13, 1e-6, 29)])}
        theta, step = min(tried, key=tried.get), 10 ** 0.25
        for _ in range(12):
            if theta > 0:
                for th in (theta / step, theta * step):
                    tried.setdefault(th, offsets(alpha, eta, th)[1])
                theta = min(tried, key=tried.get)
            step = step ** 0.5
        return theta

    theta = 0.0
    _, alpha, eta = search(theta)
    if local:
        for _ in range(2):
            theta = best_theta(alpha, eta)
            _, alpha, eta = search(theta)
    c, err = offsets(alpha, eta, theta)
    # polish: where each sample stands (waiting or hidden) fixed, the model is linear in
    # (alpha, 1/eta, theta, offsets): solve that weighted least squares exactly
    on = c[gi] + alpha * lat + bits / eta + theta * loc > 0
    free = [lat] if alpha_s is None else []
    free += [bits] if capped else []
    free += [loc] if local else []
    target = y - (0.0 if alpha_s is None else alpha * lat)  # (uncapped only: bits are 0)
    cols = np.stack(free + [(gi == g).astype(float) for g in range(len(groups))], axis=1)
    if on.sum() >= cols.shape[1]:
        sw = np.sqrt(w2[on])
        sol, *_ = np.linalg.lstsq(cols[on] * sw[:, None], target[on] * sw, rcond=None)
        at = 0
        a2 = alpha
        if alpha_s is None:
            a2, at = float(sol[0]), 1
        e2 = eta
        if capped:
            e2 = 1.0 / float(sol[at]) if sol[at] > 0 else math.inf
            at += 1
        th2 = theta
        if local:
            th2, at = float(sol[at]), at + 1
        c2 = np.where(np.bincount(gi[on], minlength=len(groups)) > 0, sol[at:], c)
        t2 = a2 * lat + bits / e2 + th2 * loc
        err2 = float(np.sum(w2 * (np.maximum(0.0, c2[gi] + t2) - y) ** 2))
        if a2 >= 0 and th2 >= 0 and ETA_RANGE[0] <= e2 <= ETA_RANGE[1] and (c2 >= floor).all() \
                and err2 < err:
            alpha, eta, theta, c = a2, e2, th2, c2
    return Link(float(alpha), float(eta), float(theta)), {g: float(o) for g, o in zip(groups, c)}


@dataclass
class Profile:
    """What one compressor costs a worker per step, measured (milliseconds, bytes).

    ``per_node``/``hierarchical``: the run's workers per node and whether its tensors took
    the hierarchical exchange (:mod:`hvd_compress.core.hierarchy`: then ``nbytes`` is a
    shard's payload, and encode/decode worked on shards).  The ``*_at`` methods scale what
    was measured to ``p`` workers in nodes of ``per_node``: a shard is ``1/L`` of a tensor
    where the exchange is hierarchical (two or more nodes of ``L`` >= 2), the whole tensor
    where it is flat."""

    compression: str
    collective: str
    compute_ms: float
    encode_ms: float
    decode_ms: float          # at ``measured_p`` workers
    nbytes: float             # payload bytes one worker sends per step
    messages: float = 1.0     # collectives per step
    measured_p: int = 1
    images_per_step: float = 1.0  # per worker
    comm_offset_ms: float = 0.0   # fitted by :func:`fit_model` (0: the plain alpha-beta time)
    #: integer sums (``sum=int``): the largest code, which with ``p`` sets the lane width
    #: (:func:`~hvd_compress.core.intsum.lane_bits`); 0: bytes do not depend on ``p``
    lane_m: int = 0
    per_node: int = 1
    hierarchical: bool = False
    local_bytes: float = 0.0  # the hierarchical exchange's dense bytes inside the node
    #: the dense gradient's bytes (float32), for that traffic at other node sizes
    dense_bytes: float = 0.0
    #: compressed tensors a step (the account's ``tensors``; 0: not counted) and what the
    #: two-phase exchange's codec work grows per tensor for each chunk more (ms,
    #: :func:`~.chunkcost.chunk_ms`: calls, or a chunk path's bookkeeping; 0: not known).
    #: A run at 2 workers hardly shows that part; at 1,024 it can be most of the step.
    tensors: float = 0.0
    chunk_ms: float = 0.0

    def active(self, p: int, per_node: int) -> bool:
        """Whether this profile's exchange is hierarchical at ``p`` workers in nodes of
        ``per_node`` (as the wrappers' rule: two or more nodes of two or more)."""
        return bool(self.hierarchical) and per_node > 1 and p // per_node > 1 and p % per_node == 0

    def traffic(self, p: int, per_node: int = 1) -> xc.Traffic:
        """One exchange of a whole tensor at ``(p, per_node)``, in fractions of the tensor
        (payload 1 byte a tensor)."""
        return _traffic(self.collective, p, per_node, self.active(p, per_node))

    def _ratio(self, field: str, p: int, per_node: int) -> float:
        """``field`` of :meth:`traffic` at ``(p, per_node)`` over the measured one."""
        then = getattr(self.traffic(max(1, self.measured_p), self.per_node), field)
        return getattr(self.traffic(p, per_node), field) / then

    def _share(self, p: int, per_node: int) -> float:
        """A worker's part of each tensor at ``(p, per_node)`` over the measured one."""
        now = 1.0 / per_node if self.active(p, per_node) else 1.0
        then = 1.0 / self.per_node if self.active(self.measured_p, self.per_node) else 1.0
        return now / then

    def nbytes_at(self, p: int, per_node: int = 1) -> float:
        """Payload bytes per worker at ``p`` workers: the measured bytes, scaled for integer
        sums by the lane width ``p`` needs (the scales, a float per tensor or bucket, are
        counted with the codes: a few per cent of QSGD's bytes), and by the shard."""
        share = self._share(p, per_node)
        if not self.lane_m:
            return self.nbytes * share
        from ..core.intsum import lane_bits
        return self.nbytes * share * lane_bits(max(1, p), self.lane_m) / \
            lane_bits(max(1, self.measured_p), self.lane_m)

    def chunks_at(self, p: int, per_node: int = 1) -> float:
        """Chunks a tensor is cut into at ``(p, per_node)``: ``p`` two-phase, the nodes
        hierarchical+two-phase, none for the other exchanges."""
        return float(self.traffic(p, per_node).encode_calls - 1)

    def encode_at(self, p: int, per_node: int = 1) -> float:
        """Values encoded: a tensor (hierarchical: a shard), two-phase also the owner's
        chunk; and the two-phase exchange's codec work per chunk (:attr:`chunk_ms`, all
        counted here) for the chunks more (or fewer) than measured."""
        more = self.chunks_at(p, per_node) - self.chunks_at(max(1, self.measured_p), self.per_node)
        return self.encode_ms * self._ratio("encoded", p, per_node) + \
            self.tensors * self.chunk_ms * more

    def decode_at(self, p: int, per_node: int = 1) -> float:
        """Allgather decodes one payload per worker (hierarchical: per node); an
        allreduce's one sum; two-phase its chunk's ``p`` payloads and the owners' chunks
        (about two tensors).  Each of a shard where hierarchical."""
        return self.decode_ms * self._ratio("decoded", p, per_node)

    def local_bytes_at(self, p: int, per_node: int = 1) -> float:
        """The dense bytes a worker moves inside its node (reduce-scatter and allgather:
        ``2 (L-1)/L`` of the gradient), where the exchange is hierarchical."""
        if not self.active(p, per_node):
            return 0.0
        dense = self.dense_bytes
        if not dense and self.local_bytes and self.active(self.measured_p, self.per_node):
            dense = self.local_bytes / (2.0 * (self.per_node - 1) / self.per_node)
        return self.traffic(p, per_node).local_bytes * dense / 4.0  # (4 bytes a value there)

    def traffic_at(self, p: int, per_node: int = 1) -> xc.Traffic:
        """A step's exchange at ``(p, per_node)``: bytes as :meth:`nbytes_at` and
        :meth:`local_bytes_at` say (values encoded and decoded in tensors)."""
        hier = self.active(p, per_node)
        whole = self.nbytes_at(p, per_node) * (per_node if hier else 1)  # a tensor's payload
        t = _traffic(self.collective, p, per_node, hier, whole)
        return dataclasses.replace(t, local_bytes=self.local_bytes_at(p, per_node))

    def as_exchange(self, collective: str, hierarchical: bool = False) -> "Profile":
        """This compressor's profile for another exchange of its payloads (``allgather``
        or ``two-phase``, hierarchical or not), as if measured at the same point: encode,
        decode and payload bytes per value as measured, counted for that exchange."""
        other = dataclasses.replace(self, collective=collective, hierarchical=hierarchical)
        p, L = max(1, self.measured_p), self.per_node
        scale = {k: getattr(other.traffic(p, L), k) / getattr(self.traffic(p, L), k)
                 for k in ("encoded", "decoded")}
        mine, theirs = (1.0 / L if f.active(p, L) else 1.0 for f in (self, other))  # shards
        more = other.chunks_at(p, L) - self.chunks_at(p, L)  # its chunks' work, at p
        return dataclasses.replace(
            other, encode_ms=self.encode_ms * scale["encoded"] + self.tensors * self.chunk_ms * more,
            decode_ms=self.decode_ms * scale["decoded"],
            nbytes=self.nbytes * theirs / mine, local_bytes=other.local_bytes_at(p, L))


class StepModel:
    """Predicted step time = compute + encode + decode(p) + comm(p, B).

    ``link``: one :class:`Link` for every collective, or a dict by collective.  Workers in
    nodes of ``per_node`` (1: every worker its own link): ``bandwidth_bps`` is each node's
    link to the others; the links inside a node run at ``local_bps`` (None: the fitted
    cost, :attr:`Link.local_s_per_bit`; one node alone is then not modelled)."""

    def __init__(self, link, profiles: dict[str, Profile]):
        self.links = dict(link) if isinstance(link, dict) else {c: link for c in LINK_OF}
        for coll, fitted in LINK_OF.items():  # two-phase: the allgather's link unless given
            if coll not in self.links and fitted in self.links:
                self.links[coll] = self.links[fitted]
        self.profiles = profiles

    def step_ms(self, compression: str, p: int, bandwidth_bps: float, per_node: int = 1,
                local_bps: float | None = None) -> float:
        f = self.profiles[compression]
        hier = f.active(p, per_node)
        if per_node > 1 and p <= per_node:  # one node: every ring inside it
            bandwidth_bps = local_bps if local_bps else math.inf
        comm = self.links[f.collective].comm_s(
            f.collective, p, f.nbytes_at(p, per_node), bandwidth_bps, f.messages, per_node, hier,
            f.local_bytes_at(p, per_node), local_bps) * 1e3
        comm = max(0.0, comm + f.comm_offset_ms)
        return f.compute_ms + f.encode_at(p, per_node) + f.decode_at(p, per_node) + comm

    def images_per_sec(self, compression: str, p: int, bandwidth_bps: float, per_node: int = 1,
                       local_bps: float | None = None) -> float:
        f = self.profiles[compression]
        return p * f.images_per_step / (self.step_ms(compression, p, bandwidth_bps, per_node,
                                                     local_bps) / 1e3)


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
