"""Compressor specs (``"topk:ratio=0.01+qsgd:levels=16"``) under their public name.

The grammar lives in the core, :mod:`hvd_compress.core.spec`; this module is the
same functions and classes, so that ``hvd_compress.spec.parse`` keeps working.
"""

from .core.spec import CompressorSpec, Spec, __getattr__, describe, parse  # noqa: F401

__all__ = ["CompressorSpec", "Spec", "parse", "describe"]  # and NAMES, SPARSIFIERS, QUANTIZERS
