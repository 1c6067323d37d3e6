"""Per-tensor compression policy: which tensors to compress, with what, from which step.

A wrapper's ``compression=`` is one spec (every tensor alike), an ordered
mapping from parameter-name patterns (``fnmatch``: ``*``, ``?``, ``[..]``) to
specs -- the first match wins, a tensor no pattern matches travels
uncompressed -- or a callable ``(name, shape, dtype) -> spec``.  On the command
line the mapping is written ``"pattern=spec;pattern=spec"``
(``"*embedding*=topk:ratio=0.001;*=fp16"``, see :func:`parse_text`).

**Small tensors travel uncompressed** (``min_numel``, default 1,024): a tensor
with fewer than ``min_numel`` elements is sent as it is, whatever the choice
says -- CGX's threshold (CGX also skips every one-dimensional tensor, and the
DGC reference every tensor of fewer than two dimensions).  Such a tensor (a
bias, a normalisation scale, a tiny layer) is 4 KB at most; compressing it
saves next to nothing on the wire, costs an encode and a collective of its
own, and -- with a sparsifier at 0.1%, which keeps k = 1 of a 16-element bias
-- starves it.  The rule is on size alone: a large vector (a classifier's
80,000-element bias) is worth compressing like any large tensor (DGC still
sends vectors whole, as its authors do, unless ``compress_1d``).
``min_numel=0`` turns the rule off (every tensor then gets its choice).  The
wrappers send all of a step's uncompressed tensors in one allreduce.

**Delayed start** (``start_step=N``): the first N optimizer steps send every
tensor uncompressed, then the plan applies, its compressors starting from empty
state (residuals at zero), as PyTorch's PowerSGD hook (``start_powerSGD_iter``)
and DeepSpeed's 1-bit Adam (its warm-up) do.

**DGC's momentum**: DGC applies momentum itself (the wrapped optimizer has
none), and sends the tensors it does not sparsify whole with momentum applied.
In a plan holding DGC, every tensor sent uncompressed -- small, unmatched,
``none`` or in the delayed start -- does the same
(``dgc:momentum=m,nesterov=..,dense=true``: momentum, no compression, summed by
allreduce), so no tensor loses its momentum.  A plan mixing DGC with another
compressor is refused when DGC carries momentum (the other tensors would have
none).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from . import registry
from . import spec as specmod

__all__ = ["DEFAULT_MIN_NUMEL", "Policy", "parse_text", "is_mapping_text", "dense_spec", "rewrite"]

DEFAULT_MIN_NUMEL = 1024
NONE = specmod.parse("none")


def is_mapping_text(text: str) -> bool:
    """Whether ``text`` is the mapping form (``pattern=spec;...``) rather than one spec:
    it holds ``;``, or an ``=`` before any ``:`` (a spec's parameters follow its ``:``)."""
    if ";" in text:
        return True
    head = text.split("=", 1)[0]
    return "=" in text and ":" not in head


def parse_text(text: str) -> list:
    """``"pattern=spec;pattern=spec"`` as ``[(pattern, Spec), ...]`` (validated)."""
    rules = []
    for item in text.split(";"):
        if not item.strip():
            continue
        pattern, eq, spec = item.partition("=")
        if not eq or not pattern.strip() or not spec.strip():
            raise ValueError(f"compression mapping: expected pattern=spec, got {item.strip()!r} "
                             f"(e.g. '*embedding*=topk:ratio=0.001;*=fp16')")
        rules.append((pattern.strip(), specmod.parse(spec.strip())))
    if not rules:
        raise ValueError(f"compression mapping {text!r} has no pattern=spec rule")
    return rules


class Policy:
    """Which compressor each tensor gets (see the module docstring).

    ``choice``: a spec (string or parsed), a mapping or list of ``(pattern, spec)``
    pairs, mapping text, or a callable ``(name, shape, dtype) -> spec``."""

    def __init__(self, choice, min_numel: int = DEFAULT_MIN_NUMEL, start_step: int = 0):
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an integer >= 0, got {min_numel!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an integer >= 0, got {start_step!r}")
        self.min_numel, self.start_step = min_numel, start_step
        self.fn = self.rules = self.single = None
        if callable(choice) and not isinstance(choice, (str, specmod.Spec)):
            self.fn = choice
        elif isinstance(choice, str) and is_mapping_text(choice):
            self.rules = parse_text(choice)
        elif isinstance(choice, Mapping) or isinstance(choice, (list, tuple)):
            pairs = list(choice.items()) if isinstance(choice, Mapping) else list(choice)
            if not pairs or any(not isinstance(p, tuple) or len(p) != 2 or
                                not isinstance(p[0], str) for p in pairs):
                raise ValueError("a compression mapping is a non-empty ordered mapping (or list "
                                 "of pairs) from name patterns to specs")
            self.rules = [(pat, specmod.parse(s)) for pat, s in pairs]
        else:
            self.single = specmod.parse(choice)
        self._chosen: dict = {}

    # -- choices ----------------------------------------------------------------------------
    def small(self, shape) -> bool:
        """Whether the rule sends a tensor of ``shape`` uncompressed."""
        if self.min_numel == 0:
            return False
        n = 1
        for d in shape:
            n *= int(d)
        return n < self.min_numel

    def choice(self, name: str, shape, dtype: str):
        """The spec chosen for a tensor, before the small-tensor rule (parsed)."""
        if self.single is not None:
            return self.single
        if self.rules is not None:
            for pattern, spec in self.rules:
                if fnmatch.fnmatchcase(name, pattern):
                    return spec
            return NONE
        got = self.fn(name, tuple(int(d) for d in shape), dtype)
        try:
            return specmod.parse(got if got is not None else "none")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"compression callable returned {got!r} for {name!r}: {exc}") from None

    def spec_for(self, name: str, shape, dtype: str):
        """The spec a tensor travels with once compression has started: its choice, or
        ``none`` where the small-tensor rule says so (memoised per name and shape)."""
        key = (name, tuple(int(d) for d in shape), dtype)
        spec = self._chosen.get(key)
        if spec is None:
            spec = NONE if self.small(shape) else self.choice(name, shape, dtype)
            self._chosen[key] = spec
        return spec

    def known_specs(self) -> list:
        """The specs this policy can choose that are known before seeing tensors."""
        if self.single is not None:
            return [self.single]
        if self.rules is not None:
            return [s for _, s in self.rules]
        return []

    @property
    def uniform(self) -> bool:
        """One spec for every tensor, no rule, no delayed start: the policy is that spec."""
        return self.single is not None and self.min_numel == 0 and self.start_step == 0

    def __str__(self) -> str:
        if self.single is not None:
            body = str(self.single)
        elif self.rules is not None:
            body = ";".join(f"{p}={s}" for p, s in self.rules)
        else:
            body = "callable:" + getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"{body} [min_numel={self.min_numel},start_step={self.start_step}]"


def dense_spec(specs) -> "specmod.Spec":
    """What a plan's uncompressed tensors travel with: ``none``, or DGC's momentum alone
    where the plan holds DGC with momentum (module docstring); raises for a plan that
    mixes DGC carrying momentum with another compressor."""
    specs = [s for s in specs if not registry.passes_through(s)]
    owners = [s for s in specs if registry.core_of(s).owns_momentum]
    moms = {}  # (momentum, nesterov, clip_norm) -> the class carrying it
    for s in owners:
        cls = registry.core_of(s)
        carried = cls.carried_momentum(s.parts[0].params)
        if carried is not None:
            moms[carried] = cls
    if not moms:
        return NONE
    if len(moms) > 1:
        raise ValueError("DGC specs with different momentum, Nesterov or clip_norm in one plan: "
                         f"{sorted(moms)}")
    others = [str(s) for s in specs if not registry.core_of(s).owns_momentum]
    if others:
        raise ValueError(f"a plan mixing DGC (which applies momentum itself) with {others} "
                         "would leave those tensors without momentum; give DGC momentum=0 "
                         "(and the wrapped optimizer its momentum), or use DGC alone")
    (carried, cls), = moms.items()
    return specmod.parse(cls.dense_with_momentum(carried))


def rewrite(policy: Policy, fn) -> Policy:
    """``policy`` with every spec it can choose passed through ``fn`` (Spec -> Spec)."""
    if policy.single is not None:
        choice = fn(policy.single)
    elif policy.rules is not None:
        choice = [(p, fn(s)) for p, s in policy.rules]
    else:
        inner = policy.fn

        def choice(name, shape, dtype):
            return fn(specmod.parse(inner(name, shape, dtype) or "none"))
        choice.__qualname__ = getattr(inner, "__qualname__", "callable")
    return Policy(choice, policy.min_numel, policy.start_step)
