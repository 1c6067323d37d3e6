"""Build a compressor from a spec: ``build("topk:ratio=0.01", backend=NUMPY)``."""

from __future__ import annotations

from .. import spec as specmod
from .backend import NUMPY
from .base import Compressor
from .dgc import DGC
from .powersgd import PowerSGD
from .quantizers import Cast16, Identity, QuantizerCompressor
from .sparsifiers import RandomK, TopK

SPARSIFIER_CLASSES = {"topk": TopK, "randomk": RandomK, "dgc": DGC}


def build(spec, backend=NUMPY, rank: int = 0, world_size: int = 1) -> Compressor:
    """A fresh compressor (with empty state) for ``spec`` on ``backend``.

    ``rank`` seeds this rank's own stochastic-rounding noise; ``world_size``
    scales DGC's local clipping and PowerSGD's warm start.
    """
    parsed = specmod.parse(spec)
    first = parsed.parts[0]
    kw = dict(backend=backend, rank=rank, world_size=world_size)
    if parsed.composed:
        second = parsed.parts[1]
        comp = SPARSIFIER_CLASSES[first.name](first.params, codec=(second.name, second.params), **kw)
    elif first.name == "none":
        comp = Identity(first.params, **kw)
    elif first.name in ("fp16", "bf16"):
        comp = Cast16(first.name, first.params, **kw)
    elif first.name in SPARSIFIER_CLASSES:
        comp = SPARSIFIER_CLASSES[first.name](first.params, **kw)
    elif first.name == "powersgd":
        comp = PowerSGD(first.params, **kw)
    else:
        comp = QuantizerCompressor(first.name, first.params, **kw)
    comp.spec = parsed
    return comp
