"""The exchange chosen by cost (``exchange="auto"``): measure the links once, agree, choose
per tensor.

At the first exchange every rank times a few collectives -- an allreduce and an allgather
of 1 KiB, 256 KiB and 4 MiB, the best of three -- over all workers, or, where the node
process sets are registered, inside its node and across nodes (its cross set). The 4 MiB
ones show a link's cost per byte where latency hides it (at 1 Gbit/s 256 KiB take 2 ms,
under the 6-8 ms a message step that 2 shared cores showed, and the fit then priced bytes
at zero; the hierarchy's dense traffic is whole tensors, too); they are left out where the
256 KiB ones took over :data:`LARGE_PROBE_BELOW_S` on some rank of the set (the cost per
byte already shows: a slow link is not kept busy for seconds). And it times its
compressors' encode, and the decode as the exchanges run it -- ``aggregate`` of up to
:data:`CODEC_PAYLOADS` payloads into one sum --, on probe tensors of two sizes (4,096
values and the largest tensor's, at most 16M), so a codec call's fixed cost is told from
its cost per value (on one size alone the fixed cost passed for a rate 20 times too high,
and the exchanges that encode fewer values per worker won wrongly). The large size is the
model's own: clipped to 1M values and decoded one payload at a time, the probes put
1-bit's decode at 1.7 ns a value where the allgather's step took 9.6 (its sum of 4 payloads
of 20.5M values runs from memory, not cache), and `auto` chose the allgather at 0.62x
two-phase's speed (docs/results/two-phase.md). The probe compressors are fresh (no state
of the user's is touched) but at the user's place in a schedule (DGC's warm-up epoch:
:func:`probe_like`), and timed on a matrix where the compressor sends vectors whole
(:func:`probe_shape`). One allreduce of the maxima
makes every rank hold the same figures (so every rank routes every tensor alike). Then
every exchange a compressor can take is run end to end on a probe tensor of the largest
tensor's size (at most 16M values: at 1M, the allgather's sum of 4 payloads ran from cache
and its probe missed what the step paid) and timed; where the slowest rank's time
exceeds the model's figure, that exchange's prices are raised by the ratio (what the model
leaves out -- the engines' own copies and waits, collectives that do not overlap, message
sizes the probes missed -- counts: on 16 cores at 200 Mbit/s the model chose the hierarchy
where it ran at half the speed of the best exchange); an exchange left untimed takes the
largest factor timed; a hierarchical exchange whose probe ran no faster than the fastest
flat exchange a tensor can take is refused for that tensor (:meth:`AutoChoice.refused`).
Never lowered: a probe that ran faster than modelled (collectives overlapping, a quiet
moment on shared cores) promises nothing for the step, and on 2 shared cores such ratios
picked the slower exchange. The links' latency and seconds per byte follow by least
squares on relative errors (:func:`.exchangecost.link_from_timings`: the small probes
price the message step), and :func:`.exchangecost.choose`
prices every exchange a tensor can take and keeps the cheapest: a hierarchy only where
priced at most 30% of the best flat exchange (:data:`.exchangecost.HIERARCHY_MARGIN`) and
not refused by its probe.
:meth:`AutoChoice.plan` says which and why, per tensor.

``links=`` (a :class:`~.exchangecost.Links`) skips the measurement (tests, or a user who
measured the cluster once).
"""

from __future__ import annotations

import time

import numpy as np

from . import exchangecost as costs
from .base import TensorMeta
from .exchange import MAX, _numel
from .stats import new_stats
from .twophase import TwoPhase, chunk_bounds, takes_two_phase

__all__ = ["AutoChoice", "PROBE_BYTES", "ENGINE_OF", "probe_shape", "probe_shapes", "probe_like"]

#: the probe collectives' sizes (bytes), each timed :data:`REPEATS` times (the best kept)
PROBE_BYTES = (1 << 10, 1 << 18, 1 << 22)
#: the largest probe size runs only where the one before took under this (seconds) on every
#: rank of the collective's set; else its rows carry :data:`SKIPPED`
LARGE_PROBE_BELOW_S = 0.05
SKIPPED = -1.0
REPEATS = 3
#: values of the tensors the codecs are timed on: this and the largest tensor's numel
#: clipped to ``CODEC_LARGE``
PROBE_VALUES = 1 << 12
CODEC_LARGE = (1 << 14, 1 << 24)
#: the decode probe sums this many payloads (or the world's size, where smaller, at least 2)
CODEC_PAYLOADS = 4
#: the end-to-end probes' tensors: the largest tensor's numel clipped to this
#: (:meth:`AutoChoice._calibrate`: every exchange a spec can take, three runs each)
CALIBRATE_LARGE = CODEC_LARGE[1]
#: the probe matrix's columns (:meth:`AutoChoice._calibrate`)
PROBE_COLS = 16
#: which engine runs each exchange (:class:`~.routed.Routed`'s keys)
ENGINE_OF = {costs.ALLREDUCE: "flat", costs.ALLGATHER: "flat", costs.TWO_PHASE: "two-phase",
             costs.HIERARCHICAL: "hierarchical",
             costs.HIERARCHICAL_TWO_PHASE: "hierarchical+two-phase"}


def _time(coll, kind: str, x, name: str) -> float:
    best = float("inf")
    for i in range(REPEATS):
        t0 = time.perf_counter()
        if kind == "allreduce":
            coll.wait(coll.allreduce(x, f"{name}.{i}"))
        else:
            coll.wait(coll.allgather(x, f"{name}.{i}"))
        best = min(best, time.perf_counter() - t0)
    return best


def probe_timings(coll, B, like, tag: str, sizes=PROBE_BYTES) -> list:
    """``[(steps, bytes, seconds)]`` of the probe collectives of ``sizes`` bytes over
    ``coll`` (its traffic by :func:`.exchangecost.traffic`'s counting: a ring allreduce, a
    direct allgather).  The largest size (of three or more) is timed only where the size
    before it took under :data:`LARGE_PROBE_BELOW_S` on every rank of ``coll`` (one
    allreduce of the maxima decides, so every rank runs the same collectives); else its
    rows' seconds are :data:`SKIPPED`."""
    p = coll.size
    rows = []
    for i, nbytes in enumerate(sizes):
        if i == len(sizes) - 1 and i >= 2:
            before = B.asarray(np.array([max(t for _, _, t in rows[-2:])]), "float64",
                               like=like)
            slowest = coll.wait(coll.allreduce(before, f"hvd_compress.probe.{tag}.large",
                                               op=MAX))
            if float(B.to_numpy(slowest).reshape(-1)[0]) >= LARGE_PROBE_BELOW_S:
                rows += [(2 * (p - 1), 2 * (p - 1) * nbytes // p, SKIPPED),
                         (p - 1, (p - 1) * nbytes, SKIPPED)]
                continue
        x = B.zeros((nbytes // 4,), "float32", like=like)
        for kind in ("allreduce", "allgather"):
            t = _time(coll, kind, x, f"hvd_compress.probe.{tag}.{kind}.{nbytes}")
            if kind == "allreduce":
                rows.append((2 * (p - 1), 2 * (p - 1) * nbytes // p, t))
            else:
                rows.append((p - 1, (p - 1) * nbytes, t))
    return rows


def scaled_shape(shape, m: int):
    """``shape`` (the largest tensor's) with its first dimension cut so that it holds at
    most ``m`` values, its other dimensions kept (a column-wise codec's columns, 1-bit's);
    None for a vector, or where one row holds more than ``m``."""
    shape = tuple(int(d) for d in shape or ())
    if len(shape) < 2 or _numel(shape[1:]) > m:
        return None
    return (min(shape[0], m // _numel(shape[1:])),) + shape[1:]


def probe_shapes(m: int, like_shape=None) -> list:
    """The shapes of about ``m`` values a probe may take, preferred first: the largest
    tensor's own (``like_shape``, :func:`scaled_shape`; where it has one), a vector, a
    matrix of :data:`PROBE_COLS` columns."""
    own = scaled_shape(like_shape, m)
    return ([own] if own is not None else []) + [(m,), (max(1, m // PROBE_COLS), PROBE_COLS)]


def probe_shape(probe, m: int, like_shape=None, score=None) -> tuple:
    """The first of :func:`probe_shapes` with the highest ``score(shape)``; by default
    whether ``probe`` splits it into chunks (DGC sends vectors whole: a vector would time
    its dense path, not the selection its matrices take). :meth:`AutoChoice._calibrate`
    scores a shape by the exchanges it allows."""
    if score is None:
        def score(shape):
            return bool(probe.chunked(shape))
    return max(probe_shapes(m, like_shape), key=score)  # (max keeps the first of equals)


def probe_like(probe, comp):
    """``probe`` (a fresh compressor) where the user's ``comp`` is in its schedule: DGC's
    warm-up epoch (a fresh DGC is at epoch 0, 25% density at ratio 0.001, where the
    synthetic benchmark runs at 0.1%)."""
    epoch = getattr(comp, "epoch", None)
    if epoch is not None and hasattr(probe, "set_epoch"):
        probe.set_epoch(int(epoch))
    return probe


def _codec_once(probe, B, like, m: int, payloads: int, tag: str, like_shape=None) -> tuple:
    """(encode, decode) seconds of ``probe`` on ``m`` values (:func:`probe_shape`), the
    best of two: the decode is ``aggregate`` of ``payloads`` payloads into one sum, as the
    exchanges decode."""
    rng = np.random.default_rng(0)
    shape = probe_shape(probe, m, like_shape)
    x = rng.standard_normal(m).astype(np.float32)
    x = B.asarray(x[:_numel(shape)].reshape(shape), "float32", like=like)
    enc = probe.encode(x, tag)  # (a first call: caches, compiled kernels)
    probe.aggregate([enc.payload] * payloads, enc)
    best_e = best_d = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        enc = probe.encode(x, tag)
        t1 = time.perf_counter()
        probe.aggregate([enc.payload] * payloads, enc)
        t2 = time.perf_counter()
        best_e, best_d = min(best_e, t1 - t0), min(best_d, t2 - t1)
    return best_e, best_d


def codec_seconds(probe, B, like, largest: int = CODEC_LARGE[1], p: int = CODEC_PAYLOADS,
                  like_shape=None) -> tuple:
    """``(encode per value, decode per value, encode per call, decode per call)`` seconds
    of ``probe`` (a fresh compressor: no state of the user's is touched) on this rank, on
    tensors where ``like`` lives: timed on :data:`PROBE_VALUES` values and on ``largest``
    (clipped to :data:`CODEC_LARGE`), the line through both (neither term negative).  The
    decode is timed summing ``p`` payloads (clipped to 2 .. :data:`CODEC_PAYLOADS`): a
    decode call and value is that time's share of one payload.  ``like_shape``: the largest
    tensor's shape, which the probes keep (:func:`probe_shape`)."""
    small = PROBE_VALUES
    large = max(CODEC_LARGE[0], min(CODEC_LARGE[1], int(largest)))
    q = max(2, min(CODEC_PAYLOADS, int(p)))
    e1, d1 = _codec_once(probe, B, like, small, q, "hvd_compress.probe.small", like_shape)
    e2, d2 = _codec_once(probe, B, like, large, q, "hvd_compress.probe.large", like_shape)

    def line(t1, t2, calls):
        per = max(0.0, (t2 - t1) / (large - small) / calls)
        return per, max(0.0, t1 / calls - per * small)
    (ev, ec), (dv, dc) = line(e1, e2, 1), line(d1, d2, q)
    return ev, dv, ec, dc


class AutoChoice:
    """What ``exchange="auto"`` knows: the world (``p`` workers in nodes of ``per_node``),
    which engines exist (``engines``: keys of :data:`ENGINE_OF`'s values), the measured
    links (or given ``links``) and each tensor's choice.  :meth:`measure` is collective;
    :meth:`route` is :class:`~.routed.Routed`'s rule.  ``known``: a dict the figures and
    choices are kept in, to be taken up by the next choice made with it for the same world
    (TensorFlow makes a tape, so a session, every step: measured once, not every step --
    and a step traced twice routes alike both times).  ``p=None``: the world's size, read
    at the first exchange (a wrapper made before ``hvd.init()``)."""

    def __init__(self, p, per_node: int, engines, world, node=None, cross=None,
                 links: costs.Links | None = None, make_engine=None, known: dict | None = None):
        self.per_node = int(per_node)
        #: ``make_engine(key, comp)``: a fresh engine of kind ``key`` for a probe compressor
        #: (None: no end-to-end timing, the model's prices unscaled)
        self.make_engine = make_engine
        self.engines = set(engines)
        self.world, self.node, self.cross = world, node, cross
        self._given = links  # (None: measured)
        self._known = {} if known is None else known
        self.p, self.rates, self.scale, self.choices = None, {}, {}, {}
        self.probed = {}
        if p is not None:
            self._set_world(int(p))

    def _set_world(self, p: int) -> None:
        """Take up what ``known`` holds for this world, or start it afresh."""
        self.p, known, links = p, self._known, self._given
        if known.get("world") != (p, self.per_node, links):
            known.clear()
            known.update(world=(p, self.per_node, links), links=links, rates={}, scale={},
                         probed={}, choices={})
        self.rates = known["rates"]      # spec text -> encode, decode per value, per call
        self.scale = known["scale"]      # spec text -> {exchange: timed / modelled seconds}
        #: spec text -> {exchange: its end-to-end probe's seconds (the slowest rank's)}
        self.probed = known.setdefault("probed", {})
        self.choices = known["choices"]  # (tensor name, shape) -> Choice

    @property
    def links(self):
        """The links measured (or given); None before the first exchange."""
        return self._known.get("links")

    @links.setter
    def links(self, value) -> None:
        self._known["links"] = value

    @property
    def probe_values(self):
        """The largest tensor's values the probes were sized by (None before they ran)."""
        return self._known.get("probe_values")

    def resize(self, p: int) -> None:
        """A new world (elastic): the links measured again at the next exchange (unless
        given), every tensor chosen again."""
        self.p = int(p)
        self.choices.clear()
        self.rates.clear()
        self.scale.clear()
        self.probed.clear()
        self.links = self._given
        self._known["measured"] = False
        self._known["world"] = (self.p, self.per_node, self._given)

    # -- the measurement (every rank at once) ------------------------------------------------
    def measure(self, comp, tensors, names, largest=None) -> None:
        """Time the links and ``comp``'s codecs (once) and agree on the figures; the probes
        take the shape of the largest of ``tensors`` and ``largest()`` (a callable, asked
        only when measuring: the wrapper's largest tensor's shape, as a first exchange sent
        as gradients are ready may hold the small ones alone)."""
        if self.p is None:
            self._set_world(int(self.world.size))
        if self._known.get("measured"):  # once per world (also where no spec has a choice)
            return
        if self.p <= 2 and self.node is None:  # nothing to choose: the allgather (allowed)
            self.links = self.links or costs.Links(0.0, 0.0)
            self._known["measured"] = True
            return
        B = comp.B
        like = tensors[0] if tensors else None
        self._known["like"] = like  # (where the tensors are: a chunk path, or none)
        with self.world.eager():
            specs = self._specs(comp, tensors, names)
            figures = []
            if self.links is None:
                if self.node is not None and self.cross is not None:
                    figures += [t for _, _, t in probe_timings(self.cross, B, like, "cross")]
                    figures += [t for _, _, t in probe_timings(self.node, B, like, "node")]
                else:
                    figures += [t for _, _, t in probe_timings(self.world, B, like, "world")]
            hint = [tuple(largest())] if largest is not None else []
            shape = max([tuple(B.shape(t)) for t in tensors or ()] + hint, key=_numel,
                        default=())
            self._known["probe_shape"], largest = shape, _numel(shape)
            rates = [codec_seconds(c, B, like, largest, self.p, shape) for c in specs.values()]
            figures += [v for pair in rates for v in pair] + [float(largest)]
            agreed = self._agree(figures, B, like, "agree")
        at, k = 0, 2 * len(PROBE_BYTES)
        if self.links is None:
            if self.node is not None and self.cross is not None:
                # the L cross sets were timed at once: a node's link carried L of them
                between = self._fit(agreed[0:k], self.cross.size, self.node.size)
                inside = self._fit(agreed[k:2 * k], self.node.size)
                at = 2 * k
                self.links = costs.Links(between[0], between[1], inside[0], inside[1])
            else:
                alpha, beta = self._fit(agreed[0:k], self.world.size)
                at = k
                self.links = costs.Links(alpha, beta)
        for key in specs:
            self.rates[key] = tuple(agreed[at:at + 4])
            at += 4
        #: the largest tensor's values, agreed: what the probes were sized by
        self._known["probe_values"] = int(agreed[at])
        if self.make_engine is not None and self._given is None and self.p > 1:
            self._calibrate(specs, B, like, int(agreed[at]), comp)
        self._known["measured"] = True

    def _agree(self, figures, B, like, tag: str) -> list:
        """Every rank's figures, the maxima over ranks (one allreduce)."""
        mine = B.asarray(np.array(figures, dtype=np.float64), "float64", like=like)
        got = self.world.wait(self.world.allreduce(mine, f"hvd_compress.probe.{tag}", op=MAX))
        return [float(v) for v in B.to_numpy(got).reshape(-1)]

    def _calibrate(self, specs, B, like, largest: int, user=None) -> None:
        """Run every exchange each spec can take on a probe tensor of up to ``largest``
        values (:data:`CALIBRATE_LARGE`), best of two after a first run (plans agreed, kernels
        compiled); keep the slowest rank's time (:attr:`probed`) and its ratio to the model's,
        per exchange, where above 1."""
        from .registry import build
        m = max(CODEC_LARGE[0], min(CALIBRATE_LARGE, largest))
        x = np.random.default_rng(1).standard_normal(m).astype(np.float32)
        runs, times = [], []
        with self.world.eager():
            for key in specs:
                # some compressors send vectors whole (DGC): each spec is timed on the first
                # shape that allows the most exchanges
                shape = probe_shape(specs[key], m, self._known.get("probe_shape"),
                                    score=lambda s, k=key: len(self.allowed(specs[k], s)))
                allowed = self.allowed(specs[key], shape)
                if len(allowed) < 2:
                    continue
                xm = x[:_numel(shape)].reshape(shape)
                for exchange in allowed:
                    comp = probe_like(build(key, backend=B, rank=self.world.rank,
                                            world_size=self.p), user)
                    engine = self.make_engine(ENGINE_OF[exchange], comp)
                    name = f"hvd_compress.probe.{exchange}"
                    best = float("inf")
                    for i in range(3):
                        xs = B.asarray(xm, "float32", like=like)
                        t0 = time.perf_counter()
                        engine.run([xs], [name], new_stats(), tag=f".{i}")
                        if i:
                            best = min(best, time.perf_counter() - t0)
                    runs.append((key, exchange, shape))
                    times.append(best)
            if not runs:
                return
            times = self._agree(times, B, like, "timed")
        for (key, exchange, shape), t in zip(runs, times):
            probe = specs[key]
            modelled = costs.cost_s(exchange, _numel(shape), self.p, self.per_node,
                                    self._payload(probe, "probe", shape), self._links(key),
                                    summable=bool(probe.summable),
                                    chunk_path=self._chunk_paths(probe, _numel(shape))
                                    .get(exchange, False))
            self.scale.setdefault(key, {})[exchange] = max(1.0, t / modelled) if modelled > 0 \
                else 1.0
            self.probed.setdefault(key, {})[exchange] = t

    def refused(self, spec: str, allowed) -> dict:
        """``{hierarchical exchange: (its probe's seconds, the fastest flat exchange, that
        one's)}`` for those of ``allowed`` whose probe ran no faster than the fastest flat
        one of ``allowed``: a hierarchy is never chosen where measured slower (its price,
        the probe scaled by a factor, can say otherwise: docs/results/two-phase.md)."""
        timed = self.probed.get(spec) or {}
        flat = {e: timed[e] for e in allowed if e in timed and not costs.is_hierarchical(e)}
        if not flat:
            return {}
        best = min(flat, key=lambda e: (flat[e], costs.EXCHANGES.index(e)))
        return {e: (timed[e], best, flat[best]) for e in allowed
                if costs.is_hierarchical(e) and e in timed and timed[e] >= flat[best]}

    @staticmethod
    def _fit(seconds, p: int, sharing: int = 1) -> tuple:
        """``(alpha, seconds per byte)`` of a link from the probes' ``seconds`` (of
        :data:`PROBE_BYTES`; :data:`SKIPPED` ones left out) over ``p`` ranks, ``sharing``
        such collectives crossing the link at once."""
        rows, i = [], 0
        for nbytes in PROBE_BYTES:
            rows.append((2 * (p - 1), sharing * 2 * (p - 1) * nbytes // p, seconds[i]))
            rows.append((p - 1, sharing * (p - 1) * nbytes, seconds[i + 1]))
            i += 2
        return costs.link_from_timings([r for r in rows if r[2] >= 0])

    def _specs(self, comp, tensors, names) -> dict:
        """Fresh compressors of the specs (sorted: the same order on every rank) whose
        tensors have a choice to make: the packed ones (summable payloads have one)."""
        from .registry import build
        specs = comp.specs() if hasattr(comp, "specs") else [comp.spec]
        out = {}
        for spec in specs:
            probe = probe_like(build(spec, backend=comp.B), comp)
            if not probe.summable and not probe.passthrough:
                out.setdefault(str(probe.spec), probe)
        return dict(sorted(out.items()))

    # -- the choice ------------------------------------------------------------------------
    def allowed(self, comp, shape) -> list:
        """The exchanges ``comp``'s tensor of ``shape`` can take with the engines here."""
        if comp.summable or getattr(comp, "passthrough", False):
            out = [costs.ALLREDUCE]
            if getattr(comp, "integer_sum", False) and "hierarchical" in self.engines:
                out.append(costs.HIERARCHICAL)
            return out
        out = [costs.ALLGATHER]
        # at two workers two-phase moves the same bytes in more steps and encodes twice
        two = self.p > 2 and takes_two_phase(comp, shape, self.p)
        if two and "two-phase" in self.engines:
            out.append(costs.TWO_PHASE)
        if "hierarchical" in self.engines:
            out.append(costs.HIERARCHICAL)
        if two and "hierarchical+two-phase" in self.engines:
            out.append(costs.HIERARCHICAL_TWO_PHASE)
        return out

    def choose(self, name: str, shape, comp) -> costs.Choice:
        """The cheapest exchange for tensor ``name`` (kept: asked again, the same answer)."""
        key = (name, tuple(shape))
        got = self.choices.get(key)
        if got is not None:
            return got
        can = self.allowed(comp, shape)
        refused = self.refused(str(comp.spec), can)
        allowed = [e for e in can if e not in refused]
        n = _numel(shape)
        if len(allowed) == 1 or self.p <= 1:
            why = "the only one left" if refused else "the only exchange it can take"
            got = costs.Choice(allowed[0], {}, f"{allowed[0]}: {why}")
        else:
            got = costs.choose(allowed, n, self.p, self.per_node, self._payload(comp, name, shape),
                               self._links(str(comp.spec)), summable=bool(comp.summable),
                               integer_sum=bool(getattr(comp, "integer_sum", False)),
                               scale=self._scale(str(comp.spec), allowed),
                               chunk_paths=self._chunk_paths(comp, n))
        if refused:
            got = costs.Choice(got.exchange, got.costs, got.reason + "; " + "; ".join(
                f"{e} refused (its probe {t * 1e3:.3g} ms, {flat} {tf * 1e3:.3g} ms)"
                for e, (t, flat, tf) in refused.items()))
        self.choices[key] = got
        return got

    def _chunk_paths(self, comp, n: int) -> dict:
        """``{exchange: whether the backend takes its chunks in one call}`` for the two-phase
        exchanges of a tensor of ``n`` values (:meth:`.twophase.TwoPhase._path`): priced as
        2 encodes and 2 decodes where it does, ``p + 1`` and ``2 p`` (a call a chunk) where not."""
        like, p, L = self._known.get("like"), self.p, max(1, min(self.per_node, self.p))

        def one_call(m, ranks):
            return ranks > 1 and m >= ranks and \
                TwoPhase._path(comp, like, chunk_bounds(m, ranks)) is not None
        return {costs.TWO_PHASE: one_call(n, p),
                costs.HIERARCHICAL_TWO_PHASE: one_call(-(-n // L), p // L)}

    def _scale(self, spec: str, allowed) -> dict:
        """The timed/modelled factors of ``spec``'s exchanges; an exchange that was not timed
        takes the largest factor timed (a model never trusted more than a measured
        exchange: on 16 cores DGC's two-phase exchanges, untimed, were chosen on the model
        alone and ran at 0.38x the allgather)."""
        timed = self.scale.get(spec) or {}
        if not timed:
            return {}
        worst = max(timed.values())
        return {e: timed.get(e, worst) for e in allowed}

    def _links(self, spec: str) -> costs.Links:
        """The measured links with ``spec``'s codec rates."""
        enc, dec, enc_call, dec_call = self.rates.get(spec, (0.0, 0.0, 0.0, 0.0))
        return costs.Links(self.links.alpha_s, self.links.s_per_byte, self.links.local_alpha_s,
                           self.links.local_s_per_byte, enc, dec, enc_call, dec_call)

    @staticmethod
    def _payload(comp, name: str, shape):
        """``m -> comp``'s payload bytes for ``m`` values of a tensor shaped like ``shape``."""
        matrix = len(shape) >= 2

        def payload(m):
            m = max(1, int(round(m)))
            return comp.payload_nbytes(TensorMeta(name, (m, 1) if matrix else (m,), "float32"))
        return payload

    def route(self, name, shape, dtype, comp) -> str:
        return ENGINE_OF[self.choose(name, shape, comp).exchange]

    def plan(self) -> dict:
        """``{tensor name: (exchange, reason)}`` of the choices made so far."""
        return {name: (c.exchange, c.reason) for (name, _), c in self.choices.items()}
