"""A tensor's compressor state held in ``tf.Variable``s, read and written in place.

The core keeps a typed state per tensor (:mod:`hvd_compress.core.state`).  A
TensorFlow compressor makes its array fields and its step counter variables once,
outside any trace, and hands the core a :class:`VariableState` over them: reading a
field reads its variable, setting one assigns it -- in eager mode and in a traced
step alike, with nothing copied into the variables and back around a call.  The
variables sit in a plain ``{field: variable}`` dict that the ``tf.Module`` tracks, so
a checkpoint names them by field, as it always has.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["VariableState", "make_variables", "shared_values", "assign_values"]


def make_variables(state, index: int) -> dict:
    """``{field: tf.Variable}`` from a fresh core state (``numel`` stays a Python int;
    ``step`` an int64 variable), named after the field and ``index``."""
    out = {}
    for key, value in state.present():
        if key == "numel":
            out[key] = value
        elif key == "step":
            out[key] = tf.Variable(tf.constant(value, tf.int64), trainable=False,
                                   name=f"hvdc_step_{index}")
        else:
            out[key] = tf.Variable(value, trainable=False, name=f"hvdc_{key}_{index}")
    return out


class VariableState:
    """The core's state for one tensor (fields of ``state_cls``) over ``variables``:
    a field reads as its variable's value (None where the tensor has no such field),
    and setting it assigns the variable.  Variables stay on the device they were made
    on, so :meth:`align` has nothing to do."""

    __slots__ = ("_cls", "_vars")

    def __init__(self, state_cls, variables: dict):
        object.__setattr__(self, "_cls", state_cls)
        object.__setattr__(self, "_vars", variables)

    def __getattr__(self, key):
        if key.startswith("_") or key not in self._cls.field_names():
            raise AttributeError(key)
        value = self._vars.get(key)
        return value.read_value() if isinstance(value, tf.Variable) else value

    def __setattr__(self, key, value) -> None:
        var = self._vars.get(key)
        if not isinstance(var, tf.Variable):
            raise AttributeError(f"{self._cls.__name__}: {key!r} is not a variable of this "
                                 "tensor's state")
        var.assign(tf.cast(value, var.dtype))

    def align(self, B, like) -> None:
        """Nothing: the variables are where they were made."""

    def present(self):
        for key in self._cls.field_names():
            if self._vars.get(key) is not None:
                yield key, getattr(self, key)

    def __getitem__(self, key: str):
        if key not in self._vars:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key) -> bool:
        return key in self._vars

    def __iter__(self):
        return (key for key, _ in self.present())

    def items(self):
        return list(self.present())


def shared_values(state_cls, variables: dict) -> dict:
    """The values (numpy) of the variables of fields every rank must hold alike."""
    return {key: var.numpy() for key, var in variables.items()
            if isinstance(var, tf.Variable) and state_cls.is_shared(key)}


def assign_values(variables: dict, values: dict) -> None:
    """Each ``values[field]`` into its variable (fields without one are skipped)."""
    for key, value in values.items():
        var = variables.get(key)
        if isinstance(var, tf.Variable):
            var.assign(np.asarray(value))
