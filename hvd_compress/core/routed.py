"""Tensors routed to one of several exchange engines, each tensor by a rule.

The exchange chosen by cost (``exchange="auto"``, :mod:`.autoexchange`) may send one tensor
by the flat engine (:class:`~.exchange.Exchange`: allreduce or allgather), another by the
two-phase one (:mod:`.twophase`) and a third hierarchically (:mod:`.hierarchy`).
:class:`Routed` holds those engines and a ``route(name, shape, dtype, comp)`` that names
each tensor's; one :meth:`send` starts every engine's part (all in flight together), one
:meth:`receive` finishes them, engine by engine in a fixed order, so every rank waits for
its collectives in the order the others started them.
"""

from __future__ import annotations

from .exchange import Runs

__all__ = ["Routed"]


class _Batch:
    def __init__(self, count, parts):
        self.count, self.parts = count, parts  # [(engine key, positions, engine batch)]


class Routed(Runs):
    """``engines``: ``{key: engine}`` (the same ``comp`` and agreed plans; the first is the
    one :meth:`agree` goes through); ``route(name, shape, dtype, comp) -> key``;
    ``before_send(tensors, names)`` (optional): what must happen on every rank before the
    first routing (the link measurements of :mod:`.autoexchange`)."""

    def __init__(self, engines: dict, route, before_send=None):
        self.engines = dict(engines)
        self.route = route
        self.before_send = before_send
        first = next(iter(self.engines.values()))
        for engine in self.engines.values():
            engine.agreed = first.agreed

    @property
    def first(self):
        return next(iter(self.engines.values()))

    @property
    def comp(self):
        return self.first.comp

    @comp.setter
    def comp(self, value):
        for engine in self.engines.values():
            engine.comp = value

    @property
    def agreed(self):
        return self.first.agreed

    @agreed.setter
    def agreed(self, value):
        for engine in self.engines.values():
            engine.agreed = value

    @property
    def size(self) -> int:
        return self.first.size

    def agree(self, plan, key=None) -> None:
        self.first.agree(plan, key)

    def send(self, tensors, names, stats, tag: str = "", noises=None) -> _Batch:
        if self.before_send is not None:
            self.before_send(tensors, names)
        B = self.comp.B
        pick = getattr(self.comp, "pick", None)
        at: dict = {}
        for i, (x, name) in enumerate(zip(tensors, names)):
            shape, dtype = tuple(B.shape(x)), B.dtype_name(x)
            comp = self.comp if pick is None else pick(name, shape, dtype)
            at.setdefault(self.route(name, shape, dtype, comp), []).append(i)
        parts = []
        for key in self.engines:  # a fixed order on every rank
            if key not in at:
                continue
            pos = at[key]
            kw = {} if noises is None else {"noises": [noises[i] for i in pos]}
            parts.append((key, pos, self.engines[key].send(
                [tensors[i] for i in pos], [names[i] for i in pos], stats, tag, **kw)))
        return _Batch(len(names), parts)

    def receive(self, batches, stats, outs=None) -> list:
        single = isinstance(batches, _Batch)
        batches = [batches] if single else list(batches)
        outs = [None] * len(batches) if outs is None else ([outs] if single else list(outs))
        results = [[None] * b.count for b in batches]
        for key, engine in self.engines.items():
            mine = [(j, pos, sent) for j, b in enumerate(batches) for k, pos, sent in b.parts
                    if k == key]
            if not mine:
                continue
            got = engine.receive([sent for _, _, sent in mine], stats,
                                 [None if outs[j] is None else [outs[j][i] for i in pos]
                                  for j, pos, _ in mine])
            for (j, pos, _), res in zip(mine, got):
                for i, r in zip(pos, res):
                    results[j][i] = r
        return results[0] if single else results
