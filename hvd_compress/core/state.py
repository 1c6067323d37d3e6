"""Per-tensor state, typed: each algorithm declares what it keeps for a tensor.

A compressor keeps one state object per tensor name (``comp.states[name]``), of its
class's :attr:`~.base.Compressor.State` -- a dataclass whose every field is marked
**shared** (equal on every rank: a resume or an elastic sync takes it from one rank)
or **per-rank** (this rank's own; never travels).  :class:`TensorState` holds what
every algorithm has; an algorithm with more subclasses it (DGC's ``u`` and ``v``,
Signum's ``momentum``, PowerSGD's ``q``)::

    @dataclass(eq=False)
    class MineState(TensorState):
        memory: Any = per_rank()

A field left None is not there (a residual without error feedback): it is neither
saved nor loaded.  ``state_dict()`` writes the fields that are there under their own
names -- the keys checkpoints have always had -- and :meth:`TensorState.from_dict`
reads them back.  Mapping-style access (``st["residual"]``) reads and writes the same
fields, for code that holds a checkpoint's key names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["TensorState", "shared", "per_rank", "SHARED", "PER_RANK", "per_rank_keys",
           "is_shared_key"]

SHARED = "shared"
PER_RANK = "per_rank"


def shared(default=None):
    """A field equal on every rank (a counter, a matrix every rank derives alike)."""
    return field(default=default, metadata={"scope": SHARED})


def per_rank(default=None):
    """A field of this rank's own (a residual, a momentum): it never travels."""
    return field(default=default, metadata={"scope": PER_RANK})


@dataclass(eq=False)
class TensorState:
    """What every compressor keeps for a tensor: its element count (a state made for
    another size is made again), the step counter that keys Random-k's indices, DGC's
    samples and PowerSGD's fresh Q, and the error-feedback residual (None without
    error feedback)."""

    numel: int = shared(0)
    step: Any = shared(0)
    residual: Any = per_rank()

    # -- what the declaration says ---------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def scope(cls, key: str) -> str:
        """:data:`SHARED` or :data:`PER_RANK` for field ``key``."""
        for f in fields(cls):
            if f.name == key:
                return f.metadata["scope"]
        raise KeyError(f"{cls.__name__} has no field {key!r}")

    @classmethod
    def is_shared(cls, key: str) -> bool:
        return cls.scope(key) == SHARED

    def present(self):
        """``(name, value)`` of every field that is there (not None), in declaration order."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value

    def align(self, B, like) -> None:
        """Every field on ``like``'s device (state restored from a checkpoint)."""
        for key, value in self.present():
            setattr(self, key, B.align(value, like))

    # -- the on-disk form -------------------------------------------------------------------
    def to_dict(self, convert) -> dict:
        """The fields that are there, under their names, each through ``convert``."""
        return {key: convert(value) for key, value in self.present()}

    @classmethod
    def from_dict(cls, values: dict, convert) -> "TensorState":
        """A state from :meth:`to_dict`'s form (each value through ``convert``)."""
        names = set(cls.field_names())
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: a checkpoint's tensor state has fields "
                             f"{unknown} that this compressor does not keep")
        return cls(**{key: convert(value) for key, value in values.items()})

    # -- mapping-style access, by the checkpoint's key names ---------------------------------
    def __getitem__(self, key: str):
        value = getattr(self, key, None) if key in self.field_names() else None
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value) -> None:
        if key not in self.field_names():
            raise KeyError(f"{type(self).__name__} has no field {key!r}")
        setattr(self, key, value)

    def __contains__(self, key) -> bool:
        return key in self.field_names() and getattr(self, key) is not None

    def __iter__(self):
        return (key for key, _ in self.present())

    def __len__(self) -> int:
        return sum(1 for _ in self.present())

    def keys(self):
        return list(self)

    def items(self):
        return list(self.present())

    def values(self):
        return [value for _, value in self.present()]

    def get(self, key: str, default=None):
        return self[key] if key in self else default


def _state_classes(cls=TensorState):
    yield cls
    for sub in cls.__subclasses__():
        yield from _state_classes(sub)


def per_rank_keys() -> frozenset:
    """Every per-rank field name that any state class declares (of the algorithms
    imported so far; :mod:`.registry` imports every built-in one)."""
    return frozenset(f.name for c in _state_classes() for f in fields(c)
                     if f.metadata["scope"] == PER_RANK)


def is_shared_key(key: str) -> bool:
    """Whether a saved tensor state's key names a shared field (no state class
    declares it per-rank)."""
    return key not in per_rank_keys()
