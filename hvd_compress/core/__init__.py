"""The framework-neutral reference core: THE definition of every compressor.

numpy only.  Every algorithm is written against the small array backend in
:mod:`.backend`; the PyTorch and TensorFlow layers run the same code on their
own backends.  Start with :func:`build` and :func:`exchange`; the protocol is
described in :mod:`.base`, the byte layouts in :mod:`.bitpack`,
:mod:`.quantizers` and :mod:`.sparsifiers`.
"""

from .backend import NUMPY, NumpyBackend
from .base import Compressor, Encoded, TensorMeta, exchange
from .dgc import DGC, warmup_density
from .powersgd import PowerSGD
from .quantizers import Cast16, Identity, QuantizerCompressor
from .registry import build
from .sparsifiers import RandomK, TopK

__all__ = ["NUMPY", "NumpyBackend", "Compressor", "Encoded", "TensorMeta", "exchange", "build",
           "DGC", "PowerSGD", "Cast16", "Identity", "QuantizerCompressor", "RandomK", "TopK",
           "warmup_density"]
