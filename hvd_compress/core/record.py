"""A typed record that still reads like the dict it replaced.

:class:`Record` is a mix-in for a dataclass: its fields are named and typed (code in the
package reads ``row.bytes``), while ``row["bytes"]``, ``row.get(...)``, ``dict(row)``,
``row.items()``, iteration over the keys and equality with a dict of the same items keep
working for code written against the dicts (the public API's plan rows, compare's rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

__all__ = ["Record"]


class Record(Mapping):
    """Mapping access to a dataclass's fields (declare the dataclass with ``eq=False`` so
    that equality stays the mapping's: same keys, same values)."""

    @classmethod
    def keys_of(cls) -> tuple:
        """The field names, in their declared order (the mapping's keys)."""
        keys = cls.__dict__.get("_record_keys")
        if keys is None:
            keys = tuple(f.name for f in fields(cls))
            cls._record_keys = keys
        return keys

    @classmethod
    def of(cls, row):
        """``row`` as this record: itself if it is one, else from a mapping's values for
        the field names (None for a name it lacks; other keys ignored)."""
        if isinstance(row, cls):
            return row
        return cls(**{k: row.get(k) for k in cls.keys_of()})

    def __getitem__(self, key: str):
        if key not in self.keys_of():
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value) -> None:
        if key not in self.keys_of():
            raise KeyError(key)
        setattr(self, key, value)

    def __iter__(self):
        return iter(self.keys_of())

    def __len__(self) -> int:
        return len(self.keys_of())

    def __contains__(self, key) -> bool:
        return key in self.keys_of()

    def __eq__(self, other) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self.items()) == dict(other.items())

    __hash__ = None  # mutable, compared by value

    def copy(self):
        return type(self)(**dict(self.items()))
