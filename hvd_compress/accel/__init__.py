"""Accelerators: faster ways to run the core's algorithms, registered against each
algorithm's class (:mod:`.registry`), never found by its name.

:mod:`.host` holds the host fast paths -- numba kernels (``kernels_*``, loaded on first
use) behind the core's ``fused_encoder`` / ``fused_decoder`` hooks for numpy arrays and
CPU torch tensors -- and the accelerator modules :mod:`.host_signs`,
:mod:`.host_stochastic`, :mod:`.host_levels` and :mod:`.host_select` register them.
Importing this package registers them and installs the host provider in the core
(:func:`hvd_compress.core.backend.set_host_fast_paths`), with :mod:`.host_chunks`'s
chunk paths for the two-phase exchange; it imports no numba.
TensorFlow's compiled ops register in :mod:`hvd_compress.tensorflow.fused_ops`.
:mod:`.device` holds the device fast paths, Triton kernels for CUDA tensors that the torch
backend asks for (triton imported on the first such question, never with the package).
"""

from ..core.backend import set_host_fast_paths
from . import host_levels, host_select, host_signs, host_stochastic  # noqa: F401  (they register)
from .host import host_decoder, host_encoder, register, unregister
from .host_chunks import chunk_path
from .registry import ByClass, requested

__all__ = ["register", "unregister", "requested", "ByClass", "host_encoder", "host_decoder"]

set_host_fast_paths(host_encoder, host_decoder, chunk_path)
