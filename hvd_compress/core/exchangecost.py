"""What each exchange of a compressed tensor costs a worker, and the cheapest one for measured links.

The exchanges (``p`` workers in nodes of ``L``, ``N = p / L`` nodes; a tensor of ``n``
values whose payload is ``C(m)`` bytes for ``m`` values):

- ``allreduce``: summable payloads, one ring allreduce of ``C(n)``;
- ``allgather``: every worker's payload gathered by all (each decodes ``p`` of them);
- ``two-phase``: the compressed allreduce of DeepSpeed's 1-bit Adam (Tang et al., 2021)
  and, for sparsifiers, of Ok-Topk (Li and Hoefler, 2022) and gTop-k (Shi et al., 2019):
  the tensor cut into ``p`` chunks (``np.array_split``: the first ``n % p`` one value
  longer); one alltoall sends chunk ``j``'s payload to its owner ``j``, who decodes the
  ``p`` payloads of its chunk, sums them and re-encodes the sum; an allgather hands every
  worker the owners' payloads.  A worker sends and receives about ``2 (p-1)/p C(n)``
  whatever ``p``, and decodes about ``2n`` values, not ``p n``;
- ``hierarchical`` (:mod:`.hierarchy`): a dense reduce-scatter inside the node (shards of
  ``ceil(n/L)`` values, padded), the shards' payloads allgathered among the nodes over the
  cross set (integer sums: allreduced), a dense allgather inside the node;
- ``hierarchical+two-phase``: as ``hierarchical``, the two-phase exchange among the nodes.

:func:`traffic` counts exactly what a worker's account reports (bytes it sends and
receives, as if each collective were direct: an allgather of rows ``c`` sends
``(p-1) c_r`` and receives the others' rows; an allreduce of ``S`` bytes
``2 (p-1) S // p`` each way) and what crosses a node's link to the others (rings cross it
once; an alltoall carries its ``L`` workers' chunks for the other nodes).
:func:`choose` prices every exchange a compressor can take with measured :class:`Links`
(the alpha-beta model: Hockney 1994) and returns the cheapest.  Pure Python: the
wrappers call it at start-up, the cost model (:mod:`hvd_compress.tools.costmodel`) with
``exact=False`` (chunks as fractions, for a whole model's payload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["ALLREDUCE", "ALLGATHER", "TWO_PHASE", "HIERARCHICAL", "HIERARCHICAL_TWO_PHASE",
           "EXCHANGES", "HIERARCHY_MARGIN", "Traffic", "Links", "Choice", "exchanges_for", "flat_of",
           "is_hierarchical",
           "chunk_lengths", "traffic", "cost_s", "choose", "link_from_timings"]

ALLREDUCE, ALLGATHER, TWO_PHASE = "allreduce", "allgather", "two-phase"
HIERARCHICAL, HIERARCHICAL_TWO_PHASE = "hierarchical", "hierarchical+two-phase"
#: every exchange, in the order ties are broken (flat before hierarchical)
EXCHANGES = (ALLREDUCE, ALLGATHER, TWO_PHASE, HIERARCHICAL, HIERARCHICAL_TWO_PHASE)
#: how much cheaper than the best flat exchange a hierarchical one must be priced to be
#: chosen (0.7: at most 30% of its price).  Its three dependent collectives on two process
#: sets wait in the step more than its probes, timed alone, show.  On 16 cores at
#: 200 Mbit/s, 2 nodes of 2: DGC's whole step through the hierarchy priced 1.31x the
#: allgather's and ran 4.6x as long (under-priced 3.5x); DGC's 80K-value bias priced 16%
#: under the allgather, and with it alone hierarchical the step ran at 0.65x; the
#: hierarchy was 0.30-0.70x the best fixed exchange in every cell measured but one
#: (1-bit at 8 workers: 1.5x the allgather, 0.68x two-phase).  On 2 cores DGC's
#: hierarchical+two-phase priced 2% under the allgather ran at 0.37x.  The model alone
#: prices it that low only with many workers a node (a top-k tensor at nodes of 8: 0.27x;
#: at 2 a node 0.68-0.70x; integer sums 0.35-0.69x their allreduce, so they keep it)
HIERARCHY_MARGIN = 0.7


def exchanges_for(summable: bool, integer_sum: bool = False) -> tuple:
    """The exchanges a compressor can take: summable payloads one allreduce (integer sums
    also the hierarchy, :func:`.hierarchy.sharded`); gathered payloads the others."""
    if summable:
        return (ALLREDUCE, HIERARCHICAL) if integer_sum else (ALLREDUCE,)
    return (ALLGATHER, TWO_PHASE, HIERARCHICAL, HIERARCHICAL_TWO_PHASE)


def is_hierarchical(exchange: str) -> bool:
    return exchange in (HIERARCHICAL, HIERARCHICAL_TWO_PHASE)


def flat_of(exchange: str, summable: bool = False) -> str:
    """What a hierarchical exchange is where there are not two nodes of two workers or more
    (the wrappers' rule): its exchange among all workers."""
    if exchange == HIERARCHICAL:
        return ALLREDUCE if summable else ALLGATHER
    return TWO_PHASE if exchange == HIERARCHICAL_TWO_PHASE else exchange


def _check_exchange(exchange: str) -> None:
    if exchange not in EXCHANGES:
        raise ValueError(f"unknown exchange {exchange!r} (one of {', '.join(EXCHANGES)})")


def chunk_lengths(n, p: int, exact: bool = True) -> list:
    """The ``p`` chunks of ``n`` values: ``np.array_split``'s lengths (the first ``n % p``
    one longer); ``exact=False``: ``n / p`` each."""
    if not exact:
        return [n / p] * p
    q, extra = divmod(int(n), p)
    return [q + 1] * extra + [q] * (p - extra)


def _div(a, b, exact: bool):
    return a // b if exact else a / b


@dataclass(frozen=True)
class Traffic:
    """One exchange of one tensor, for one worker.

    ``sent``/``received``: bytes on the exchange's collectives between workers (flat: with
    all workers; hierarchical: with its cross set, one worker a node), as the account
    counts them.  ``wire``: bytes a node's link to the other nodes carries in its busier
    direction (where all workers share one node: the worker's own ``max(sent, received)``).
    ``local_bytes``: the hierarchy's dense bytes this worker sends inside its node.
    ``steps``/``local_steps``: latency-bound message steps between workers / inside the
    node.  ``encoded``/``decoded``: values this worker encodes and decodes, in
    ``encode_calls``/``decode_calls`` codec calls (each has a fixed cost: a kernel launch,
    Python: the two-phase exchange makes ``p + 1`` and ``2p`` of them, the allgather 1 and
    ``p``)."""

    sent: float
    received: float
    wire: float
    local_bytes: float
    steps: int
    local_steps: int
    encoded: float
    decoded: float
    encode_calls: int = 1
    decode_calls: int = 1


def _node_span(p: int, per_node: int) -> int:
    """Workers a node holds (1: every worker its own link)."""
    return max(1, min(int(per_node), p))


def _two_phase(lengths: list, r: int, first: int, size: int, pb: Callable, ob: Callable):
    """(sent, received, wire, decoded) of the two-phase exchange of chunks ``lengths`` for
    worker ``r`` (``pb``: a worker's payload bytes for a chunk, ``ob``: an owner's); ``wire``
    through the link of the node holding ranks ``first`` to ``first + size - 1`` (rings in
    rank order cross it once)."""
    p = len(lengths)
    sizes = {m: (pb(m), ob(m)) for m in set(lengths)}
    cb = [sizes[m][0] for m in lengths]
    own = [sizes[m][1] for m in lengths]
    total, owned = sum(cb), sum(own)
    # alltoall: chunk j's payload to owner j; allgather: the owners' payloads
    out = (total - cb[r]) + (p - 1) * own[r]
    got = (p - 1) * cb[r] + (owned - own[r])
    mine = sum(cb[first:first + size])
    a2a_out, a2a_in = size * (total - mine), (p - size) * mine
    ring_out, ring_in = owned - own[(first + size) % p], owned - own[first]
    wire = max(a2a_out + ring_out, a2a_in + ring_in)
    return out, got, wire, p * lengths[r] + sum(lengths)


def _calls(p: int, chunk_path: bool) -> tuple:
    """The two-phase exchange's codec calls a tensor over ``p`` ranks: a call a chunk
    (``p`` worker's and the owner's encodes; ``p`` payloads summed, ``p`` owners' decoded),
    or the chunk path's one call each."""
    return (2, 2) if chunk_path else (p + 1, 2 * p)


def traffic(exchange: str, numel, p: int, per_node: int, payload_bytes: Callable, *,
            summable: bool = False, rank: int = 0, exact: bool = True,
            owner_bytes: Callable | None = None, chunk_path: bool = False) -> Traffic:
    """What ``exchange`` of a tensor of ``numel`` values costs worker ``rank`` of ``p`` in
    nodes of ``per_node`` (ranks node by node).  ``payload_bytes(m)``: the compressor's
    payload bytes for ``m`` values; ``owner_bytes(m)``: the two-phase owner's for its chunk
    of ``m`` (its re-encoding: :func:`.twophase.owner_of`; default ``payload_bytes``).
    ``summable``: the hierarchy's payloads are summed between nodes (integer sums), not
    gathered.  A hierarchical exchange needs two nodes of two workers or more
    (:func:`flat_of` says what runs otherwise).  ``exact=False``: chunks and shards as
    fractions of ``numel`` and no rounding (the cost model's).  ``chunk_path``: the
    backend takes all of a tensor's chunks in one call (:mod:`hvd_compress.accel.host_chunks`):
    the two-phase exchanges make 2 encodes and 2 decodes, not ``p + 1`` and ``2 p``."""
    _check_exchange(exchange)
    owner_bytes = owner_bytes or payload_bytes
    n, L = numel, _node_span(p, per_node)
    if p <= 1:
        return Traffic(0, 0, 0, 0, 0, 0, n, n)
    one_node = L >= p
    first = (rank // L) * L
    if exchange == ALLREDUCE:
        s = 2 * (p - 1) * payload_bytes(n)
        b = _div(s, p, exact)
        return Traffic(b, b, b, 0, 2 * (p - 1), 0, n, n)
    if exchange == ALLGATHER:
        c = payload_bytes(n)
        b = (p - 1) * c  # rows all of c: the ring's links carry p - 1 of them
        return Traffic(b, b, b, 0, p - 1, 0, n, p * n, 1, p)
    if exchange == TWO_PHASE:
        lengths = chunk_lengths(n, p, exact)
        out, got, wire, dec = _two_phase(lengths, rank, first, L, payload_bytes, owner_bytes)
        return Traffic(out, got, max(out, got) if one_node else wire, 0, 2 * (p - 1), 0,
                       n + lengths[rank], dec, *_calls(p, chunk_path))
    # hierarchical: shards of ceil(n/L), the dense node traffic, the cross set's exchange
    if L < 2 or p % L or p // L < 2:
        raise ValueError(f"{exchange} needs two nodes of two workers or more (p={p}, "
                         f"per_node={per_node}): it runs as {flat_of(exchange, summable)}")
    N = p // L
    k = -(-int(n) // L) if exact else n / L
    local = _div((L - 1) * 4 * k * L, L, exact) + (L - 1) * 4 * k  # reduce-scatter, allgather
    if exchange == HIERARCHICAL:
        between = traffic(ALLREDUCE if summable else ALLGATHER, k, N, 1, payload_bytes,
                          rank=rank // L, exact=exact)
    else:
        lengths = chunk_lengths(k, N, exact)
        out, got, _, dec = _two_phase(lengths, rank // L, rank // L, 1, payload_bytes, owner_bytes)
        between = Traffic(out, got, max(out, got), 0, 2 * (N - 1), 0, k + lengths[rank // L], dec,
                          *_calls(N, chunk_path))
    # the node's link carries its L workers' cross sets, each worker on its own node there
    return Traffic(between.sent, between.received, L * between.wire, local, between.steps,
                   2 * (L - 1), between.encoded, between.decoded, between.encode_calls,
                   between.decode_calls)


@dataclass(frozen=True)
class Links:
    """Measured costs: ``alpha_s`` per message step and ``s_per_byte`` through a node's link
    to the other nodes (every worker its own node: its link); the same inside a node, per
    worker (None: the workers share no node, or it was not measured: no hierarchy then);
    the codec's seconds per value encoded and decoded, and per call (what a call costs
    whatever its size: on a probe of 65K values that was most of it).  Fit them
    (:func:`link_from_timings`) with the bytes :attr:`Traffic.wire` counts: the ``L``
    cross sets of a node timed at once put ``L`` times a worker's bytes on its link."""

    alpha_s: float
    s_per_byte: float
    local_alpha_s: float | None = None
    local_s_per_byte: float | None = None
    encode_s: float = 0.0
    decode_s: float = 0.0
    encode_call_s: float = 0.0
    decode_call_s: float = 0.0

    @property
    def inside(self) -> bool:
        """Whether the links inside a node were measured."""
        return self.local_alpha_s is not None and self.local_s_per_byte is not None


def _priced(t: Traffic, links: Links, one_node: bool) -> float:
    codec = (t.encoded * links.encode_s + t.decoded * links.decode_s
             + t.encode_calls * links.encode_call_s + t.decode_calls * links.decode_call_s)
    if one_node and links.inside:  # every collective runs inside the node
        return t.steps * links.local_alpha_s + t.wire * links.local_s_per_byte + codec
    s = t.steps * links.alpha_s + t.wire * links.s_per_byte + codec
    if t.local_bytes or t.local_steps:
        if not links.inside:
            raise ValueError("the hierarchy's cost needs the links inside a node (Links.local_*)")
        s += t.local_steps * links.local_alpha_s + t.local_bytes * links.local_s_per_byte
    return s


def cost_s(exchange: str, numel, p: int, per_node: int, payload_bytes: Callable, links: Links, *,
           summable: bool = False, exact: bool = True, owner_bytes: Callable | None = None,
           chunk_path: bool = False) -> float:
    """Seconds ``exchange`` of one tensor takes by the alpha-beta model: message steps times
    the latency, the node link's bytes times the seconds per byte, the hierarchy's node
    traffic at the links inside, values encoded and decoded at the codec's rates (and
    calls: ``chunk_path`` as :func:`traffic` takes it)."""
    t = traffic(exchange, numel, p, per_node, payload_bytes, summable=summable, exact=exact,
                owner_bytes=owner_bytes, chunk_path=chunk_path)
    return _priced(t, links, _node_span(p, per_node) >= p)


@dataclass(frozen=True)
class Choice:
    """:func:`choose`'s answer: the exchange, each candidate's seconds, and why."""

    exchange: str
    costs: dict
    reason: str


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def choose(allowed, numel, p: int, per_node: int, payload_bytes: Callable, links: Links, *,
           summable: bool = False, integer_sum: bool = False,
           owner_bytes: Callable | None = None, scale: dict | None = None,
           chunk_paths: dict | None = None) -> Choice:
    """The cheapest of ``allowed`` exchanges (those the compressor can take:
    :func:`exchanges_for`) for a tensor of ``numel`` values.  A hierarchical exchange is a
    candidate only with two nodes of two workers or more and measured links inside a node,
    and wins only where it is priced at least :data:`HIERARCHY_MARGIN` under the best flat
    exchange.  ``reason``: one
    line for the plan printout.  ``owner_bytes``: as :func:`traffic` takes it.  ``scale``:
    ``{exchange: factor}`` each exchange's price is multiplied by (the exchanges timed end
    to end over the model's figure: :mod:`.autoexchange`).  ``chunk_paths``: ``{exchange:
    bool}``, whether the backend's chunk path takes that exchange's chunks
    (:func:`traffic`'s ``chunk_path``)."""
    can = exchanges_for(summable, integer_sum)
    wanted = [e for e in EXCHANGES if e in set(allowed) & set(can)]
    if not wanted:
        raise ValueError(f"none of {sorted(allowed)} fits this compressor (it can take "
                         f"{', '.join(can)})")
    L = _node_span(p, per_node)
    nodes_ok = L >= 2 and p % L == 0 and p // L >= 2
    skipped = [e for e in wanted if is_hierarchical(e) and not (nodes_ok and links.inside)]
    paths = chunk_paths or {}
    costs = {e: cost_s(e, numel, p, per_node, payload_bytes, links, summable=summable,
                       owner_bytes=owner_bytes, chunk_path=bool(paths.get(e)))
             for e in wanted if e not in skipped}
    if not costs:  # the hierarchy alone asked for where it cannot run: its flat exchange
        flat = flat_of(wanted[0], summable)
        costs = {flat: cost_s(flat, numel, p, per_node, payload_bytes, links, summable=summable,
                              owner_bytes=owner_bytes)}
    scaled = {e: f for e, f in (scale or {}).items() if e in costs and f != 1.0}
    costs = {e: c * scaled.get(e, 1.0) for e, c in costs.items()}
    best = min(costs, key=lambda e: (costs[e], EXCHANGES.index(e)))
    flat = [e for e in costs if not is_hierarchical(e)]
    kept_flat = ""
    if is_hierarchical(best) and flat:
        near = min(flat, key=lambda e: (costs[e], EXCHANGES.index(e)))
        if costs[best] > costs[near] * (1.0 - HIERARCHY_MARGIN):
            best, kept_flat = near, f"; a hierarchy must be {HIERARCHY_MARGIN:.0%} cheaper"
    others = sorted((e for e in costs if e != best), key=lambda e: costs[e])
    reason = f"{best}: {_ms(costs[best])}" + (
        " vs " + ", ".join(f"{e} {_ms(costs[e])}" for e in others) if others else
        " (the only exchange priced)")
    reason += kept_flat
    if scaled:
        reason += "; timed/modelled " + ", ".join(f"{e} {f:.2g}" for e, f in scaled.items())
    if skipped:
        why = "one node" if not nodes_ok else "no link inside a node measured"
        reason += f"; {', '.join(skipped)} not priced ({why})"
    return Choice(best, costs, reason)


def link_from_timings(timings) -> tuple:
    """``(alpha_s, s_per_byte)`` from timed collectives ``(steps, bytes, seconds)`` (each
    collective's :attr:`Traffic.steps` and ``wire``): least squares on the relative errors
    (each row weighted by ``1 / seconds**2``), neither term negative.  Relative, because a
    probe's noise grows with its time: fitted on the seconds themselves, a few ms of noise
    on the 4 MiB probes outweighed the 1 KiB ones whole, and the fit put 0 s on a message
    step (16 cores, 200 Mbit/s) or 31 ms (2 cores) -- the small tensors' prices."""
    rows = [(float(a), float(b), float(t)) for a, b, t in timings]
    if not rows:
        raise ValueError("link_from_timings: no timing")
    floor = max(t for _, _, t in rows) * 1e-9 or 1e-30  # (a time of 0: weighted as this)
    weights = [1.0 / max(t, floor) ** 2 for _, _, t in rows]
    wrows = list(zip(weights, rows))

    def through_zero(pairs):  # t = x * v, weighted least squares
        den = sum(w * x * x for w, x, _ in pairs)
        return max(0.0, sum(w * x * t for w, x, t in pairs) / den) if den else 0.0

    saa = sum(w * a * a for w, (a, _, _) in wrows)
    sbb = sum(w * b * b for w, (_, b, _) in wrows)
    sab = sum(w * a * b for w, (a, b, _) in wrows)
    sat = sum(w * a * t for w, (a, _, t) in wrows)
    sbt = sum(w * b * t for w, (_, b, t) in wrows)
    det = saa * sbb - sab * sab
    if det > 1e-12 * max(saa * sbb, 1e-300):
        alpha, beta = (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det
        if alpha >= 0 and beta >= 0:
            return alpha, beta
    # collinear or a negative term: the better of one term alone
    fits = [(through_zero([(w, a, t) for w, (a, _, t) in wrows]), 0.0),
            (0.0, through_zero([(w, b, t) for w, (_, b, t) in wrows]))]
    return min(fits, key=lambda f: sum(w * (f[0] * a + f[1] * b - t) ** 2
                                       for w, (a, b, t) in wrows))
