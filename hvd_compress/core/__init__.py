"""The framework-neutral reference core: THE definition of every compressor.

numpy only.  Every algorithm is written against the small array backend in
:mod:`.backend`; the PyTorch and TensorFlow layers run the same code on their
own backends.  Start with :func:`build` and :class:`Exchange`; the protocol is
described in :mod:`.exchange` and :mod:`.base`, the byte layouts in :mod:`.bitpack`,
:mod:`.quantizers` and :mod:`.sparsifiers`.
"""

from .agreement import PlanMismatchError
from .backend import NUMPY, NumpyBackend
from .base import Compressor, Encoded, TensorMeta
from .dgc import DGC, warmup_density
from .exchange import Collectives, Exchange, Loopback, ProcessSetCollectives, new_stats
from .powersgd import PowerSGD
from .quantizers import Cast16, Identity, QuantizerCompressor
from .registry import build
from .sparsifiers import RandomK, TopK

__all__ = ["NUMPY", "NumpyBackend", "Compressor", "Encoded", "TensorMeta", "Exchange", "Collectives",
           "Loopback", "ProcessSetCollectives", "new_stats", "build",
           "DGC", "PowerSGD", "Cast16", "Identity", "QuantizerCompressor", "RandomK", "TopK",
           "warmup_density", "PlanMismatchError"]
