"""The wrapper session: what every wrapper does around the exchange engine, written once.

The PyTorch optimizer, the TensorFlow tape and the Keras optimizer are shells around
one :class:`Session` each.  The shell turns its framework's gradients into tensors
and names and applies the averages; the session owns the decisions they share:

* the engine, by ``exchange``: the flat :class:`~.core.exchange.Exchange` (``"allgather"``,
  ``"allreduce"``), the two-phase one (:mod:`.core.twophase`), the hierarchical one
  (:mod:`.core.hierarchy`; ``"hierarchical"``, ``"hierarchical+two-phase"``: the node
  process sets must be registered, :func:`.nodes.node_sets`), or -- ``"auto"``, the
  default -- all of them behind one router (:mod:`.core.routed`), each tensor sent the way
  the measured links make cheapest (:mod:`.core.autoexchange`);
* the world it is bound to (rank, size), followed after an elastic reset, and the
  plan the ranks agreed on (:mod:`.core.agreement`), checked again when it changes;
* grouping: which tensors share a collective (a per-tensor plan's uncompressed
  tensors travel together), the backward passes counted before a group is sent,
  and the batches in flight;
* the optimizer step count, which the ranks agree on before a delayed start, and
  the local-SGD / DGA phase it puts a step in (:mod:`.localsteps`);
* the account: this step's :class:`~.core.stats.Stats`, the last step's, the totals.

It imports no framework: Horovod's module (``horovod.torch`` or
``horovod.tensorflow``), the collectives class (:class:`~.torch.collectives.HorovodTorch`,
:class:`~.tensorflow.exchange.HorovodTF`) and the engine classes come in as arguments.
"""

from __future__ import annotations

import os

import numpy as np

from . import nodes
from .core import exchangecost, registry
from .core.autoexchange import AutoChoice
from .core.exchange import MAX, Exchange, _numel
from .core.hierarchy import Hierarchical, sharded
from .core.routed import Routed
from .core.stats import Stats
from .core.twophase import TwoPhase, takes_two_phase
from .localsteps import LocalSGDSchedule
from .processset import check_process_set, exchanges, included, set_size

__all__ = ["Session", "fuse_uncompressed", "TOO_MANY_PASSES", "EXCHANGES", "resolve_exchange"]

#: what a wrapper's ``exchange=`` takes
AUTO = "auto"
EXCHANGES = (AUTO,) + exchangecost.EXCHANGES
#: the environment variable that sets what ``exchange="auto"`` (the default) means
EXCHANGE_ENV = "HVD_COMPRESS_EXCHANGE"


def resolve_exchange(exchange, hierarchical) -> str:
    """The exchange a wrapper runs, from its ``exchange=`` and the older ``hierarchical=``
    (True: the hierarchy, as ``exchange="hierarchical"``; False: none).  ``"auto"`` may be
    pinned by the environment (:data:`EXCHANGE_ENV`: a whole job at one exchange; with
    ``hierarchical=False`` a pinned hierarchy runs flat)."""
    given = exchange not in (None, AUTO)
    if not given:
        exchange = os.environ.get(EXCHANGE_ENV) or AUTO
    if exchange not in EXCHANGES:
        where = "exchange=" if given else f"{EXCHANGE_ENV}="
        raise ValueError(f"{where}{exchange!r}: expected one of {', '.join(EXCHANGES)}")
    hier = exchangecost.is_hierarchical(exchange)
    if hierarchical is True:
        if exchange == AUTO or (hier and not given):
            return exchange if hier else exchangecost.HIERARCHICAL
        if not hier:
            raise ValueError(f"hierarchical=True and exchange={exchange!r} disagree; "
                             "give one of them")
    if hierarchical is False and hier:
        if given:
            raise ValueError(f"hierarchical=False and exchange={exchange!r} disagree; "
                             "give one of them")
        return exchangecost.flat_of(exchange)
    return exchange


TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before "
                   "call to step(). Increase backward_passes_per_step to accumulate gradients "
                   "locally.")


def fuse_uncompressed(groups, uncompressed, least: int = 2) -> list:
    """``groups`` (tuples of tensors) with every one-tensor group that ``uncompressed``
    says travels uncompressed merged into one group, first (one allreduce per step for
    them all), the others as they were; unchanged when fewer than ``least`` would merge."""
    dense, rest = [], []
    for group in groups:
        (dense if len(group) == 1 and uncompressed(group[0]) else rest).append(group)
    if len(dense) < max(least, 1):
        return list(groups)
    return [tuple(x for (x,) in dense)] + rest


def _size(world):
    """The world's size, None before ``hvd.init()`` (a wrapper may be made before it)."""
    try:
        return world.size
    except ValueError:
        return None


class Session:
    """One wrapper's exchange session over ``process_set`` (module docstring).

    ``hvd``: Horovod's framework module; ``collectives``: a class taking a process set
    (the engine's :class:`~.core.exchange.Collectives`); ``op``,
    ``predivide`` (``gradient_predivide_factor``), ``hierarchical`` and ``exchange``
    (:func:`resolve_exchange`) as the wrappers take them; ``links``: measured
    :class:`~.core.exchangecost.Links` for ``"auto"`` (None: measured at the first
    exchange); ``flat`` / ``tiered`` / ``twophase`` / ``routed``: the engine classes
    (TensorFlow runs its own outside AutoGraph); ``local_sgd``, ``period``, ``warmup``, ``delay``: the local
    steps (:mod:`.localsteps`); ``on_world(size, reset)``: what the shell does once
    bound to a world (the torch optimizer registers its gradient hooks)."""

    def __init__(self, hvd, process_set, collectives, *, op, predivide: float = 1.0,
                 hierarchical=None, exchange=AUTO, links=None, flat=Exchange,
                 tiered=Hierarchical, twophase=TwoPhase, routed=Routed, local_sgd: bool = False,
                 period: int = 1, warmup: int = 0, delay: int = 0, on_world=None):
        check_process_set(hvd, process_set)
        self.hvd, self.process_set, self.collectives = hvd, process_set, collectives
        self.op, self.predivide = op, float(predivide)
        #: the exchange asked for (:data:`EXCHANGES`)
        self.exchange_mode = resolve_exchange(exchange, hierarchical)
        forced = exchangecost.is_hierarchical(self.exchange_mode)
        self._sets = None if hierarchical is False or not (forced or self.exchange_mode == AUTO) \
            else nodes.node_sets(hvd, process_set)
        if forced and self._sets is None:
            raise ValueError(nodes.MISSING)
        self._flat, self._tiered, self._on_world = flat, tiered, on_world
        self._twophase, self._routed, self._links = twophase, routed, links
        #: what ``"auto"`` measured and chose (:class:`~.core.autoexchange.AutoChoice`)
        self.auto = None
        self.schedule = LocalSGDSchedule(period, warmup) if local_sgd else None
        self.delay = int(delay)
        self.engine = self._dense = self.comp = None
        self._plan = self._on_first = None
        self.world = None        # (rank, size) the compressor is bound to
        self.steps = 0           # optimizer steps taken
        self._step_unsure = True  # (see agree_on_step)
        self.stats, self.last, self.totals = Stats(), Stats(), Stats()
        self.groups, self.pending = [], {}  # group -> Batch in flight
        self._group_of, self._left, self._ready, self._passes = {}, {}, {}, 1

    # -- the engine ------------------------------------------------------------------------
    @property
    def hierarchical(self) -> bool:
        """Whether compressed gradients go by a hierarchical exchange (forced, or chosen by
        ``"auto"`` for a tensor so far)."""
        if self.auto is not None:
            return any(exchangecost.is_hierarchical(e) for e, _ in self.auto.plan().values())
        return exchangecost.is_hierarchical(self.exchange_mode)

    def exchange_of(self, row) -> tuple:
        """``(exchange, why)`` for a plan row's tensor (:class:`~.core.planrow.PlanRow`):
        ``"auto"``'s choice once made (empty before its first exchange), else the exchange
        asked for where the tensor can take it, or the flat engine's way and why not."""
        if self.auto is not None:
            return self.auto.plan().get(row.name, ("", ""))
        mode = self.exchange_mode
        probe = registry.build(row.compression) if row.compressed else None
        flat = exchangecost.ALLGATHER if probe is not None and not probe.summable and \
            not probe.passthrough else exchangecost.ALLREDUCE
        p = self.engine.size if self.engine is not None else 1
        if mode == exchangecost.TWO_PHASE and not (probe and takes_two_phase(probe, row.shape, p)):
            return flat, f"{flat}: not two-phase (summable, whole, or fewer values than ranks)"
        if exchangecost.is_hierarchical(mode) and not (probe and sharded(probe)):
            return flat, f"{flat}: summable, not hierarchical"
        if mode in (exchangecost.ALLGATHER, exchangecost.ALLREDUCE, AUTO):
            return flat, f"{flat}: asked for" if mode != AUTO else f"{flat}: one worker"
        return mode, f"{mode}: asked for"

    def with_exchanges(self, rows) -> list:
        """Plan rows (:class:`~.core.planrow.PlanRow`) with each tensor's exchange and why."""
        for row in rows:
            row.exchange, row.why = self.exchange_of(row)
        return rows

    @property
    def average(self) -> bool:
        return self.op == self.hvd.Average

    def make_engine(self, comp, agreed=None, wrap=None, known=None):
        """The engine for compressor ``comp`` (kept as :attr:`engine`); ``agreed``: a set
        of agreed plans to share (TensorFlow keeps it with the compressor); ``wrap``:
        what the shell puts around it (the torch optimizer's sparse-gradient path);
        ``known``: where ``exchange="auto"`` keeps what it measured and chose
        (:class:`~.core.autoexchange.AutoChoice`; TensorFlow: with the compressor)."""
        kw = dict(average=self.average, predivide=self.predivide, op=self.op)
        world = self.collectives(self.process_set)
        mode, self.auto = self.exchange_mode, None
        if mode == exchangecost.TWO_PHASE:
            engine = self._twophase(comp, world, **kw)
        elif exchangecost.is_hierarchical(mode):
            engine = self._tiered_engine(comp, world, mode, kw)
        elif mode == AUTO and _size(world) != 1:
            def make(key, c):  # an engine of kind ``key`` (also for auto's probe compressors)
                if key == "flat":
                    return self._flat(c, world, **kw)
                if key == "two-phase":
                    return self._twophase(c, world, **kw)
                return self._tiered_engine(c, world, key, kw)
            keys = ["flat", "two-phase"]
            node = cross = None
            if self._sets is not None:
                node, cross = (self.collectives(s) for s in self._sets[:2])
                keys += [exchangecost.HIERARCHICAL, exchangecost.HIERARCHICAL_TWO_PHASE]
            engines = {key: make(key, comp) for key in keys}
            per_node = node.size if node is not None else 1
            choice = self.auto = AutoChoice(_size(world), per_node, engines, world, node, cross,
                                            links=self._links, make_engine=make, known=known)
            engine = self._routed(engines, choice.route, before_send=lambda xs, ns: choice.measure(
                engine.comp, xs, ns, largest=lambda: self.largest_grouped(engine.comp.B)))
        else:  # allgather, allreduce (summable or not: the flat engine sends each its way)
            if mode == exchangecost.ALLREDUCE:
                gathered = [str(s) for s in (comp.specs() if hasattr(comp, "specs")
                                             else [comp.spec]) if not registry.summable(s)]
                if gathered:
                    raise ValueError(f"exchange='allreduce' needs payloads that add up; "
                                     f"{', '.join(gathered)} are gathered (use 'auto', "
                                     "'allgather' or 'two-phase')")
            engine = self._flat(comp, world, **kw)
        if agreed is not None:
            engine.agreed = agreed
        self.engine = engine if wrap is None else wrap(engine)
        return self.engine

    def _tiered_engine(self, comp, world, mode: str, kw: dict):
        """The hierarchical engine (``mode``: with the allgather or the two-phase exchange
        among the nodes)."""
        nodes.finish_together(self.hvd)
        node, cross, index = self._sets
        between = self._twophase if mode == exchangecost.HIERARCHICAL_TWO_PHASE else Exchange
        return self._tiered(comp, world, self.collectives(node), self.collectives(cross), index,
                            between=between, **kw)

    def dense_engine(self, make):
        """A plain averaging engine for tensors that are not gradients (local SGD's
        parameters and buffers); ``make()``: the ``none`` compressor.  Made once."""
        if self._dense is None:
            self._dense = self._flat(make(), self.collectives(self.process_set),
                                     op=self.hvd.Average)
        return self._dense

    def average_dense(self, tensors, names, make) -> None:
        """Average ``tensors`` (named ``names``) over the ranks in place, uncompressed, one
        collective each, all in flight at once; ``make()``: the ``none`` compressor."""
        self.ready_engine()  # the ranks' plans agree (checked once, before any collective)
        engine = self.dense_engine(make)
        batches = [engine.send([t], [n], self.stats) for n, t in zip(names, tensors)]
        engine.receive(batches, self.stats, outs=[[t] for t in tensors])

    def hierarchy(self) -> str:
        """How the engine crosses nodes, as a plan shows it."""
        if self._sets is None or not (self.hierarchical or self.exchange_mode == AUTO):
            return "off"
        size = self.collectives(self._sets[0]).size
        return f"nodes of {size}" if self.hierarchical else f"nodes of {size} (auto)"

    # -- the world -------------------------------------------------------------------------
    def exchanges(self) -> bool:
        """Whether this rank takes part (:func:`.processset.exchanges`)."""
        return exchanges(self.hvd, self.process_set)

    def communicates(self) -> bool:
        """Whether this rank exchanges with at least one other."""
        return self.exchanges() and set_size(self.hvd, self.process_set) > 1

    def follow_world(self, comp, reset: bool = False) -> bool:
        """Bind ``comp`` to Horovod's current rank and the set's size if they changed
        (cheap when nothing did); a new size makes the ranks check their plan again.
        ``reset``: after an elastic reset, on every rank at once -- forget the agreed
        plans and the batches in flight too.  Returns whether this rank is in the set."""
        if not included(self.hvd, self.process_set):
            return False
        world = (self.hvd.rank(), set_size(self.hvd, self.process_set))
        if world != self.world:
            resized = self.world is None or world[1] != self.world[1]
            comp.bind(*world)
            self.world = world
            if resized:  # every rank sees a new size at the same exchange
                self.forget_agreement()
                if self.auto is not None:  # measured and chosen again for the new world
                    self.auto.resize(world[1])
        if reset:
            self.forget_agreement()
            self.clear_pending()
            self.reset_passes()
        if self._on_world is not None:
            self._on_world(world[1], reset)
        return True

    def forget_agreement(self) -> None:
        for engine in (self.engine, self._dense):
            if engine is not None:
                engine.agreed.clear()

    def agree(self, plan, key=None, on_first=None) -> None:
        """The ranks check ``plan`` (a dict or a callable making one) once per ``key``
        (:meth:`~.core.exchange.Exchange.agree`); ``on_first()`` runs right after the
        first agreement among two or more ranks (the torch optimizer takes the root's
        shared compressor state there)."""
        first = key is None or key not in self.engine.agreed
        self.engine.agree(plan, key=key)
        if first and on_first is not None and self.engine.size > 1:
            on_first()

    def agree_on_step(self) -> None:
        """With a delayed start, every rank must be on the same side of it: at the first
        exchange (and after a load) the ranks take the largest step count any of them
        has (Horovod's resume pattern loads the checkpoint on rank 0 only)."""
        if not self._step_unsure:
            return
        self._step_unsure = False
        B, coll = self.engine.comp.B, self.collectives(self.process_set)
        mine = B.from_numpy(np.array([self.steps], dtype=np.int64))
        got = coll.wait(coll.allreduce(mine, "hvd_compress.policy_step", op=MAX))
        self.steps = int(B.to_numpy(got).reshape(-1)[0])

    def set_steps(self, steps: int, sure: bool) -> None:
        """The step count from a checkpoint (``sure`` False: the ranks agree on it again
        before a delayed start) or from the root (``sure``: equal on every rank)."""
        self.steps = int(steps)
        self._step_unsure = not sure

    def take_shared_state(self, comp, root_rank: int, shared, merge) -> None:
        """Every rank takes ``root_rank``'s shared compressor state (``shared(sd)``: a
        ``state_dict()`` without its per-rank part) and step count, keeping its own
        per-rank state (``merge(shared, mine)``).  Collective: all ranks call it."""
        mine = comp.state_dict()
        sent = None
        if self.hvd.rank() == root_rank:
            sent = {"shared": shared(mine), "optimizer_steps": self.steps}
        got = self.hvd.broadcast_object(sent, root_rank, name="hvd_compress.elastic.state",
                                        process_set=self.process_set)
        comp.load_state_dict(merge(got["shared"], mine))
        self.set_steps(got["optimizer_steps"], sure=True)

    # -- local steps -----------------------------------------------------------------------
    def local_phase(self) -> bool:
        """Whether the current step is a worker's own (local SGD, past its warm-up)."""
        return self.schedule is not None and not self.schedule.synchronous(self.steps)

    def averages_now(self, step: int) -> bool:
        """Whether local SGD averages after step ``step``."""
        return bool(self.schedule.averages_after(step))

    # -- a wrapper that sends by groups (the torch optimizer) ------------------------------
    def attach(self, comp, plan, on_first=None, wrap=None):
        """Drive compression ``comp`` (a frontend whose ``core`` ``bind()`` rebuilds): make
        the engine (``wrap``: see :meth:`make_engine`); ``plan()``: the wrapper's exchange
        plan, which the ranks check before its first exchange (:meth:`ready_engine`);
        ``on_first``: see :meth:`agree`."""
        self.comp, self._plan, self._on_first = comp, plan, on_first
        return self.make_engine(comp.core, wrap=wrap)

    def ready_engine(self):
        """The engine, driving the compressor's current core, once the ranks agreed on the
        plan (one small allgather at the first exchange; again after a new world)."""
        self.engine.comp = self.comp.core
        self.agree(self._plan, key="optimizer", on_first=self._on_first)
        return self.engine

    def send(self, group, grads, names, tag: str = "") -> None:
        """Start ``group``'s exchange of ``grads`` (named ``names``; ``tag`` sets DGA's
        steps in flight apart), after following the world and, before a per-tensor
        policy's delayed start, agreeing on the step count; the batch waits in
        :attr:`pending`."""
        comp = self.comp
        self.follow_world(comp)  # (after an elastic reset: a new rank or size)
        policy = getattr(comp, "policy", None)
        if policy is not None:  # the delayed start counts these
            if policy.start_step:
                self.agree_on_step()
            comp.policy_step = self.steps
        self.pending[group] = self.ready_engine().send(grads, names, self.stats, tag)

    def send_missing(self, launch) -> None:
        """``launch(group)`` for every group not yet sent this step (hooks that did not
        fire: a parameter without a gradient on this rank)."""
        for group in self.groups:
            if group not in self.pending:
                launch(group)

    def synchronize(self, launch, collect) -> None:
        """Finish the step: send what is missing, ``collect(pending)`` every batch in
        flight, start the passes afresh and close the account."""
        self.send_missing(launch)
        collect(self.pending)
        self.clear_pending()
        self.reset_passes()
        self.close_step()

    # -- grouping and passes ---------------------------------------------------------------
    def set_groups(self, groups, passes: int) -> None:
        """The groups that travel together, and the backward passes summed before one is
        sent (Horovod's ``backward_passes_per_step``; 1 per local step in local SGD)."""
        self.groups = list(groups)
        self._group_of = {x: g for g in self.groups for x in g}
        self._passes = int(passes)
        self.reset_passes()

    def largest_grouped(self, B) -> tuple:
        """The shape of the largest tensor of :meth:`set_groups`' groups (``()``: none set):
        what ``auto`` times its probes on, where the first exchange (a group sent as its
        gradients are ready) may hold only the small tensors."""
        return max((tuple(B.shape(x)) for x in self._group_of), key=_numel, default=())

    def set_passes(self, passes: int) -> None:
        self._passes = int(passes)
        self.reset_passes()

    def set_period(self, passes: int) -> None:
        """Horovod's ``backward_passes_per_step`` changed: local SGD's averaging period
        (each pass stays a local step), else the passes summed before a group is sent."""
        if self.schedule is not None:
            self.schedule.period = int(passes)
        self.set_passes(1 if self.schedule is not None else passes)

    def reset_passes(self) -> None:
        self._left = {x: self._passes for x in self._group_of}

    def ready(self, x):
        """A backward pass produced ``x``'s gradient; returns its group once every
        member has had all its passes (the group to send), else None."""
        if self._left[x] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._left[x] -= 1
        if self._left[x] == 0:
            group = self._group_of[x]
            ready = self._ready.setdefault(group, set())
            ready.add(x)
            if len(ready) == len(group):
                return group
        return None

    def clear_pending(self) -> None:
        self.pending.clear()
        self._ready.clear()

    def take_pending(self) -> dict:
        """The batches in flight (group -> Batch), handed over and forgotten here."""
        pending = dict(self.pending)
        self.clear_pending()
        return pending

    def exchange(self, grads, names, describe) -> list:
        """One exchange of ``grads`` (named ``names``) with the engine, into this step's
        account: each tensor in a collective of its own, except a per-tensor plan's
        uncompressed tensors, which go together in one (in the delayed start, every
        tensor); ``describe(x)``: a tensor's ``(shape, dtype name)``."""
        engine, stats = self.engine, self.stats
        comp = engine.comp
        phased = getattr(comp, "phased", None)  # a per-tensor policy's delayed start
        if phased is None:
            return engine.run_each(grads, names, stats)

        def run():
            dense = comp.dense_spec()
            groups = fuse_uncompressed(
                [(i,) for i in range(len(grads))],
                lambda i: comp.spec_for(names[i], *describe(grads[i])) == dense, least=1)
            batches = [engine.send([grads[i] for i in g], [names[i] for i in g], stats)
                       for g in groups]
            out = [None] * len(grads)
            for group, res in zip(groups, engine.receive(batches, stats)):
                for i, r in zip(group, res):
                    out[i] = r
            return out

        return phased(run)

    # -- the account -----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start this step's account afresh."""
        self.stats = Stats()

    def reopen_step(self) -> None:
        """The last step's account continues (TensorFlow's local SGD: the averaging after
        the update belongs to the step whose gradients it follows)."""
        for key in self.last:
            self.totals[key] -= self.last[key]
        self.stats, self.last = self.last, Stats()

    def close_step(self) -> None:
        """This step's account becomes :attr:`last` and is added to :attr:`totals`."""
        self.last = self.stats
        self.totals.add(self.stats)
        self.stats = Stats()
