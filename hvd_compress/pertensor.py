"""A per-tensor policy as the framework wrappers hold it (framework-neutral).

:class:`PolicyFrontend` is what a wrapper's ``compression`` becomes when the
choice differs per tensor, the small-tensor rule is on, or compression starts
late (:mod:`hvd_compress.core.policy`): one compressor object per distinct
spec (the user's own object for its spec, so ``comp.set_epoch`` and its state
stay theirs), and :meth:`PolicyFrontend.pick`, which the exchange engine calls
to get each tensor's compressor.  The PyTorch and TensorFlow classes add only
how a child compressor is made.
"""

from __future__ import annotations

from . import spec as specmod
from .core import policy as policymod
from .core import registry
from .core.base import TensorMeta
from .core.planrow import PlanRow

__all__ = ["PlanRow", "PolicyFrontend", "format_plan", "resolve"]


def resolve(compression, min_numel, start_step, frontend_cls, policy_cls, make):
    """What a wrapper's ``compression=`` becomes (both frameworks): a policy object as it
    is; the compressor itself (a given object of ``frontend_cls``, or ``make(spec)``)
    where one spec goes to every tensor from the first step (``min_numel=0``,
    ``start_step=0``) or it is ``none``; else a ``policy_cls`` over it, reusing a given
    object for its spec."""
    from .frontend import choice_of
    choice = choice_of(compression)
    if isinstance(choice, PolicyFrontend):
        return choice
    given = choice if isinstance(choice, frontend_cls) else None
    policy = policymod.Policy(given.spec if given is not None else choice, min_numel, start_step)
    if policy.uniform or (policy.single is not None and registry.passes_through(policy.single)):
        return given if given is not None else make(policy.single)
    return policy_cls(policy, given)


class PolicyFrontend:
    """Mixin: the compressors of a :class:`~hvd_compress.core.policy.Policy`.

    Subclasses set ``BACKEND`` and define :meth:`_make_child` (a framework compressor
    for a spec) and :meth:`_child_protocol` (what the engine drives for it)."""

    def _init_policy(self, policy, given=None):
        self.policy = policy
        self._given = given
        self._children = {}      # spec text -> framework compressor
        self._dense = None       # the spec uncompressed tensors travel with
        self._epoch = None
        #: optimizer steps done (the delayed start; PyTorch counts here)
        self.policy_step = 0
        #: set while tracing the delayed start's branch (TensorFlow)
        self.force_dense = False
        self._rank, self._world_size = None, None  # what bind() set; children follow

    # -- the compressors -----------------------------------------------------------------
    def _make_child(self, spec):
        raise NotImplementedError

    def _child_protocol(self, child):
        raise NotImplementedError

    def child(self, spec):
        """The compressor object for ``spec`` (made on first use)."""
        key = str(spec)
        comp = self._children.get(key)
        if comp is None:
            given = self._given
            comp = given if given is not None and str(given.spec) == key else \
                self._make_child(specmod.parse(spec))
            if self._epoch is not None:
                comp.set_epoch(self._epoch)
            if self._rank is not None:  # (the user's own object too)
                comp = comp.bind(self._rank, self._world_size)
            self._children[key] = comp
            self._child_added(key, comp)
        return comp

    def _child_added(self, key, comp) -> None:
        """Hook (TensorFlow tracks the child for checkpoints)."""

    def bind(self, rank: int, world_size: int):
        """Bind every compressor, and those made later, to ``rank`` of ``world_size``."""
        self._rank, self._world_size = rank, world_size
        for comp in self._children.values():
            comp.bind(rank, world_size)
        return self

    @property
    def children(self) -> dict:
        return dict(self._children)

    def settle(self, entries) -> None:
        """Fix the spec of uncompressed tensors from every tensor's choice (``entries``:
        ``(name, shape, dtype)``); a wrapper calls it before its first exchange."""
        if self._dense is None:
            self._dense = policymod.dense_spec(
                [self.policy.spec_for(n, s, d) for n, s, d in entries] +
                self.policy.known_specs())

    def dense_spec(self):
        """The spec uncompressed tensors travel with: fixed by :meth:`settle` (from every
        tensor's choice); before it, from the specs known without tensors."""
        if self._dense is not None:
            return self._dense
        return policymod.dense_spec(self.policy.known_specs())

    def reset_plan(self) -> None:
        """Forget the settled plan (the policy was rewritten)."""
        self._dense = None
        self._children.clear()

    def dense_phase(self) -> bool:
        return self.force_dense or self.policy_step < self.policy.start_step

    def spec_for(self, name: str, shape, dtype: str, dense: bool | None = None):
        """The spec ``name`` travels with now (``dense``: in the delayed start or not;
        None: as the step counter says)."""
        spec = self.policy.spec_for(name, shape, dtype)
        if (self.dense_phase() if dense is None else dense) or registry.passes_through(spec):
            return self.dense_spec()
        return spec

    def pick(self, name: str, shape, dtype: str):
        """What the exchange engine encodes ``name`` with (see :class:`~.core.exchange.Exchange`)."""
        return self._child_protocol(self.child(self.spec_for(name, shape, dtype)))

    # -- what wrappers ask ---------------------------------------------------------------
    @property
    def B(self):
        return self.BACKEND

    @property
    def spec(self):
        """The one spec every tensor may get (None for a mapping or a callable)."""
        return self.policy.single

    def specs(self) -> list:
        """The specs known before seeing tensors, and the uncompressed tensors' spec."""
        return self.policy.known_specs() + [self.dense_spec()]

    def describe(self) -> str:
        return str(self.policy)

    @property
    def passthrough(self) -> bool:
        """Every tensor uncompressed with the user's op (``none`` throughout)."""
        return self.policy.fn is None and all(registry.passes_through(s) for s in self.specs())

    def compresses(self, name: str, shape, dtype: str) -> bool:
        """Whether the plan compresses ``name`` once compression has started."""
        spec = self.spec_for(name, shape, dtype, dense=False)
        return not registry.passes_through(spec) and spec != self.dense_spec()

    def passthrough_for(self, name: str, shape, dtype: str) -> bool:
        return self.child(self.spec_for(name, shape, dtype)).passthrough

    @property
    def epoch(self):
        """The warm-up epoch last set (:meth:`set_epoch`; None before)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> bool:
        """DGC's warm-up epoch, for every compressor of the plan (and those made later)."""
        self._epoch = int(epoch)
        return any([bool(c.set_epoch(epoch)) for c in self._children.values()])

    def plan(self, entries) -> list[PlanRow]:
        """Per tensor (``entries``: ``(name, shape, dtype)``) its :class:`PlanRow`: name,
        shape, the spec it travels with once compression runs, and its payload bytes per
        step now."""
        self.settle(entries)
        rows = []
        for name, shape, dtype in entries:
            shape = tuple(int(d) for d in shape)
            spec = self.spec_for(name, shape, dtype, dense=False)
            core = self.child(spec).core
            rows.append(PlanRow(name, shape, dtype, str(spec), self.compresses(name, shape, dtype),
                                int(core.payload_nbytes(TensorMeta(name, shape, dtype)))))
        return rows

    # -- state ---------------------------------------------------------------------------
    def policy_state(self) -> dict:
        return {"policy": str(self.policy), "step": int(self.policy_step),
                "compressors": {k: c.state_dict() for k, c in self._children.items()}}

    def load_policy_state(self, sd: dict) -> None:
        if sd.get("policy") != str(self.policy):
            raise ValueError(f"checkpoint was made with compression {sd.get('policy')!r}, "
                             f"this wrapper uses {str(self.policy)!r}")
        self.policy_step = int(sd.get("step", 0))
        for key, state in sd.get("compressors", {}).items():
            self.child(specmod.parse(key)).load_state_dict(state)


def format_plan(rows, start_step: int = 0) -> str:
    """The plan as a table (what the examples print on rank 0); ``rows``: :class:`PlanRow`
    objects, or dicts of their fields."""
    rows = [PlanRow.of(r) for r in rows]
    width = max([len(r.name) for r in rows] + [6])
    lines = [f"{'tensor':<{width}}  {'shape':<16} {'bytes/step':>11}  compression"]
    for r in rows:
        shape = "x".join(map(str, r.shape)) or "scalar"
        shown = r.compression if r.compressed else \
            "none" + (" (with DGC's momentum)" if registry.core_of(r.compression).owns_momentum
                      else "")
        lines.append(f"{r.name:<{width}}  {shape:<16} {r.bytes:>11,}  {shown}"
                     + (f"  [{r.why}]" if r.why else ""))
    total = sum(r.bytes for r in rows)
    squeezed = sum(1 for r in rows if r.compressed)
    lines.append(f"{len(rows)} tensors, {squeezed} compressed, {total:,} bytes/step"
                 + (f"; uncompressed for the first {start_step} steps" if start_step else ""))
    return "\n".join(lines)
