"""Accelerators found by the algorithm's class, never by its name.

An accelerator (the numba host paths of :mod:`.host`, TensorFlow's compiled ops of
:mod:`hvd_compress.tensorflow.fused_ops`) registers what it does for an algorithm
against that algorithm's class -- the codec's or the compressor's -- in a
:class:`ByClass` table, and the backends' ``fused_encoder`` / ``fused_decoder`` hooks
look the object they are asked about up by its class.  Adding an algorithm with a
fast path is then its core module and one accelerator module that calls ``register``:
no table elsewhere names it.
"""

from __future__ import annotations

import os

__all__ = ["ByClass", "requested"]


def requested() -> bool:
    """Whether fast paths may run at all: ``HVD_COMPRESS_FUSED=0`` turns off the numba
    kernels and TensorFlow's compiled ops (the reference chains run)."""
    return os.environ.get("HVD_COMPRESS_FUSED", "1") != "0"


class ByClass(dict):
    """Entries keyed by an algorithm's class.  :meth:`find` looks along the class's
    method resolution order, so a subclass has its base's entry unless it registers
    its own -- ``None`` for none, where the subclass computes something else."""

    def find(self, obj):
        """The entry for ``type(obj)`` or its nearest base that has one, or None."""
        for cls in type(obj).__mro__:
            if cls in self:
                return self[cls]
        return None
