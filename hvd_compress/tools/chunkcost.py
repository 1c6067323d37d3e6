"""What the two-phase exchange's codec work costs a worker for each worker more, measured.

The two-phase exchange (:mod:`hvd_compress.core.twophase`) cuts a tensor into a chunk per
worker: its bytes per worker stay put as workers are added, but the codec work has a part
per chunk (a call each where the backend has no chunk path for the compressor, the
bookkeeping of each chunk where it has one) that a run at 2 or 4 workers hardly shows and
1,024 workers multiply.  :func:`chunk_ms` times the exchange itself on one rank whose peers
mirror it (:class:`Mirror`: each sends what this one sends) on a small tensor at two worker
counts; the slope is what the cost model (:class:`~.costmodel.Profile` ``chunk_ms``) adds
per tensor and worker.  Measured on the machine that runs it, with the compressor's code
as it is -- not a constant of the algorithm.
"""

from __future__ import annotations

import numpy as np

from ..core import build
from ..core.exchange import Collectives
from ..core.stats import new_stats
from ..core.twophase import TwoPhase, takes_two_phase

__all__ = ["Mirror", "chunk_ms", "PROBE_SHAPE", "WORKERS"]

#: the probe tensor: small, so that what grows with the workers is the chunks' cost, not
#: the values'; a matrix (DGC sends vectors whole)
PROBE_SHAPE = (256, 64)
#: the worker counts timed (the line through both)
WORKERS = (16, 256)
#: steps timed at each worker count (the best kept): 1-bit's chunk path grows about 1 us a
#: worker over a step of 1-2 ms, and the best of 3 put its slope at -1.6 to 3.1 us (1 of 20
#: at or under 0, which a CI run's test caught); the best of 10 at 0.75-1.4 us (20 of 20)
REPEATS = 10
_CACHE: dict = {}


class Mirror(Collectives):
    """Rank 0 of ``size`` in one process, its peers sending what it sends: an alltoall gives
    back ``size`` copies of the row it sent itself, an allgather ``size`` copies of its row,
    an allreduce ``size`` times its tensor.  Fixed-size payloads only (every rank's chunk
    then has the same bytes)."""

    rank = 0

    def __init__(self, size: int, B):
        self.size, self.B = int(size), B

    def allreduce(self, flat, name, op=None, prescale=1.0, postscale=1.0):
        return ("one", flat * float(self.size))

    def allgather(self, flat, name):
        return ("one", self.B.concat([flat] * self.size))

    def alltoall(self, flat, splits, name):
        own = int(splits[0])
        return ("pair", (self.B.concat([flat[:own]] * self.size), [own] * self.size))

    def wait(self, handle):
        return handle[1]


def _backend(framework: str):
    """``(B, like)``: torch's CPU backend where ``framework`` is torch and it imports, else
    numpy's."""
    if framework == "torch":
        try:
            import torch

            from ..torch.backend import TorchBackend
            return TorchBackend(), torch.zeros(1)
        except ImportError:
            pass
    from ..core.backend import NUMPY
    return NUMPY, np.zeros(1, np.float32)


def _codec_ms(spec: str, B, like, p: int) -> float | None:
    """The best of :data:`REPEATS` steps' encode + decode ms of the probe tensor on rank 0 of
    ``p`` (None where the spec does not take the two-phase exchange)."""
    comp = build(spec, backend=B, rank=0, world_size=p)
    if comp.B is not B or not takes_two_phase(comp, PROBE_SHAPE, p) or \
            getattr(comp, "variable_size", False):
        return None
    engine = TwoPhase(comp, Mirror(p, B))
    rng = np.random.default_rng(0)
    best = float("inf")
    for step in range(REPEATS + 1):  # (the first: states, compiled kernels)
        x = B.asarray(rng.standard_normal(PROBE_SHAPE).astype(np.float32), "float32", like=like)
        stats = new_stats()
        engine.run([x], ["hvd_compress.chunk_probe"], stats, tag=f".{step}")
        if step:  # the codec's part (the mirrored collectives' copies are not the exchange's)
            best = min(best, stats.encode_ms + stats.decode_ms)
    return best


def chunk_ms(spec: str, framework: str = "torch", workers=WORKERS) -> float:
    """Milliseconds the two-phase exchange's codec work grows per tensor for each worker
    more (never negative), on this machine, in ``framework``'s CPU backend; the most over
    a per-tensor spec's compressors; 0 where none takes the two-phase exchange."""
    from .plan import specs_of
    key = (spec, framework, tuple(workers))
    if key not in _CACHE:
        B, like = _backend(framework)
        slopes = [0.0]
        for one in specs_of(spec):
            a, b = (_codec_ms(one, B, like, p) for p in workers)
            if a is not None and b is not None:
                slopes.append(max(0.0, (b - a) / (workers[1] - workers[0])))
        _CACHE[key] = max(slopes)
    return _CACHE[key]
