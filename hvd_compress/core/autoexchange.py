"""The exchange chosen by cost (``exchange="auto"``): measure the links once, agree, choose
per tensor.

At the first exchange every rank times a few collectives -- an allreduce and an allgather
of 1 KiB and of 256 KiB, the best of three -- over all workers, and, where the node process
sets are registered, inside its node and across nodes (its cross set); and it times its
compressors' encode and decode on a probe tensor.  One allreduce of the maxima makes every
rank hold the same figures (so every rank routes every tensor alike).  The links' latency
and seconds per byte follow by least squares (:func:`.exchangecost.link_from_timings`),
and :func:`.exchangecost.choose` prices every exchange a tensor can take and keeps the
cheapest: a hierarchy only where the measurement says it is cheaper.  :meth:`AutoChoice.plan`
says which and why, per tensor.

``links=`` (a :class:`~.exchangecost.Links`) skips the measurement (tests, or a user who
measured the cluster once).
"""

from __future__ import annotations

import time

import numpy as np

from . import exchangecost as costs
from .base import TensorMeta
from .exchange import MAX
from .twophase import takes_two_phase

__all__ = ["AutoChoice", "PROBE_BYTES", "ENGINE_OF"]

#: the probe collectives' sizes (bytes), each timed :data:`REPEATS` times (the best kept)
PROBE_BYTES = (1 << 10, 1 << 18)
REPEATS = 3
#: values of the tensor the codecs are timed on
PROBE_VALUES = 1 << 16
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


def probe_timings(coll, B, like, tag: str) -> list:
    """``[(steps, bytes, seconds)]`` of the probe collectives over ``coll`` (its traffic by
    :func:`.exchangecost.traffic`'s counting: a ring allreduce, a direct allgather)."""
    p = coll.size
    rows = []
    for nbytes in PROBE_BYTES:
        x = B.zeros((nbytes // 4,), "float32", like=like)
        for kind in ("allreduce", "allgather"):
            t = _time(coll, kind, x, f"hvd_compress.probe.{tag}.{kind}.{nbytes}")
            if kind == "allreduce":
                rows.append((2 * (p - 1), 2 * (p - 1) * nbytes // p, t))
            else:
                rows.append((p - 1, (p - 1) * nbytes, t))
    return rows


def codec_seconds(probe, B, like) -> tuple:
    """``(encode, decode)`` seconds per value of ``probe`` (a fresh compressor: no state of
    the user's is touched) on this rank, on a tensor where ``like`` lives."""
    rng = np.random.default_rng(0)
    x = B.asarray(rng.standard_normal(PROBE_VALUES).astype(np.float32), "float32", like=like)
    enc = probe.encode(x, "hvd_compress.probe")  # (a first call: caches, compiled kernels)
    t0 = time.perf_counter()
    enc = probe.encode(x, "hvd_compress.probe")
    t1 = time.perf_counter()
    probe.decode(enc.payload, enc.meta, enc.ctx)
    t2 = time.perf_counter()
    return (t1 - t0) / PROBE_VALUES, (t2 - t1) / PROBE_VALUES


class AutoChoice:
    """What ``exchange="auto"`` knows: the world (``p`` workers in nodes of ``per_node``),
    which engines exist (``engines``: keys of :data:`ENGINE_OF`'s values), the measured
    links (or given ``links``) and each tensor's choice.  :meth:`measure` is collective;
    :meth:`route` is :class:`~.routed.Routed`'s rule."""

    def __init__(self, p: int, per_node: int, engines, world, node=None, cross=None,
                 links: costs.Links | None = None):
        self.p, self.per_node = int(p), int(per_node)
        self.engines = set(engines)
        self.world, self.node, self.cross = world, node, cross
        self.links = links
        self._given = links is not None
        self.rates = {}     # spec text -> (encode, decode) seconds per value
        self.choices = {}   # tensor name -> Choice

    def resize(self, p: int) -> None:
        """A new world (elastic): the links measured again at the next exchange (unless
        given), every tensor chosen again."""
        self.p = int(p)
        self.choices.clear()
        self.rates.clear()
        if not self._given:
            self.links = None

    # -- the measurement (every rank at once) ------------------------------------------------
    def measure(self, comp, tensors, names) -> None:
        """Time the links and ``comp``'s codecs (once) and agree on the figures."""
        if self.links is not None and self.rates:
            return
        B = comp.B
        like = tensors[0] if tensors else None
        with self.world.eager():
            specs = self._specs(comp, tensors, names)
            figures = []
            if self.links is None:
                if self.node is not None and self.cross is not None:
                    figures += [t for _, _, t in probe_timings(self.cross, B, like, "cross")]
                    figures += [t for _, _, t in probe_timings(self.node, B, like, "node")]
                else:
                    figures += [t for _, _, t in probe_timings(self.world, B, like, "world")]
            rates = [codec_seconds(c, B, like) for c in specs.values()]
            figures += [v for pair in rates for v in pair]
            mine = B.asarray(np.array(figures, dtype=np.float64), "float64", like=like)
            agreed = self.world.wait(self.world.allreduce(mine, "hvd_compress.probe.agree",
                                                          op=MAX))
            agreed = [float(v) for v in B.to_numpy(agreed).reshape(-1)]
        at = 0
        if self.links is None:
            if self.node is not None and self.cross is not None:
                # the L cross sets were timed at once: a node's link carried L of them
                between = self._fit(agreed[0:4], self.cross.size, self.node.size)
                inside = self._fit(agreed[4:8], self.node.size)
                at = 8
                self.links = costs.Links(between[0], between[1], inside[0], inside[1])
            else:
                alpha, beta = self._fit(agreed[0:4], self.world.size)
                at = 4
                self.links = costs.Links(alpha, beta)
        for key in specs:
            self.rates[key] = (agreed[at], agreed[at + 1])
            at += 2

    @staticmethod
    def _fit(seconds, p: int, sharing: int = 1) -> tuple:
        """``(alpha, seconds per byte)`` of a link from the probes' ``seconds`` over ``p``
        ranks, ``sharing`` such collectives crossing the link at once."""
        rows, i = [], 0
        for nbytes in PROBE_BYTES:
            rows.append((2 * (p - 1), sharing * 2 * (p - 1) * nbytes // p, seconds[i]))
            rows.append((p - 1, sharing * (p - 1) * nbytes, seconds[i + 1]))
            i += 2
        return costs.link_from_timings(rows)

    def _specs(self, comp, tensors, names) -> dict:
        """Fresh compressors of the specs (sorted: the same order on every rank) whose
        tensors have a choice to make: the packed ones (summable payloads have one)."""
        from .registry import build
        specs = comp.specs() if hasattr(comp, "specs") else [comp.spec]
        out = {}
        for spec in specs:
            probe = build(spec, backend=comp.B)
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
        two = takes_two_phase(comp, shape, self.p)
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
        allowed = self.allowed(comp, shape)
        n = 1
        for d in shape:
            n *= int(d)
        if len(allowed) == 1 or self.p <= 1:
            got = costs.Choice(allowed[0], {}, f"{allowed[0]}: the only exchange it can take")
        else:
            enc, dec = self.rates.get(str(comp.spec), (0.0, 0.0))
            links = costs.Links(self.links.alpha_s, self.links.s_per_byte,
                                self.links.local_alpha_s, self.links.local_s_per_byte, enc, dec)
            matrix = len(shape) >= 2

            def payload(m):
                m = max(1, int(round(m)))
                return comp.payload_nbytes(TensorMeta(name, (m, 1) if matrix else (m,),
                                                      "float32"))
            got = costs.choose(allowed, n, self.p, self.per_node, payload, links,
                               summable=bool(comp.summable),
                               integer_sum=bool(getattr(comp, "integer_sum", False)))
        self.choices[key] = got
        return got

    def route(self, name, shape, dtype, comp) -> str:
        return ENGINE_OF[self.choose(name, shape, comp).exchange]

    def plan(self) -> dict:
        """``{tensor name: (exchange, reason)}`` of the choices made so far."""
        return {name: (c.exchange, c.reason) for (name, _), c in self.choices.items()}
