"""A tensor's chunk encodings in one buffer: what a backend's chunk path hands the
two-phase exchange (:mod:`.twophase`).

A chunk path (:mod:`hvd_compress.accel.host_chunks`) encodes all ``p`` chunks of a tensor
in one call, their payloads end to end in one host byte buffer.  Handing the exchange ``p``
:class:`~.base.Encoded` records (a backend slice, a record and a state lookup each) made
each chunk cost microseconds of bookkeeping, 56 ms a step at 1,024 workers.  A
:class:`Chunks` keeps the buffer with its offsets and sizes; the exchange lays its
alltoall rows out from it in one call (``path.rows``) and reads a chunk as an
:class:`~.base.Encoded` only where it needs one (the chunk it owns, a fallback).
"""

from __future__ import annotations

import numpy as np

from .base import Encoded

__all__ = ["Chunks"]


class Chunks:
    """Chunk ``j``'s payload is ``host[offs[j]:offs[j] + nbytes[j]]`` (uint8, host), its
    meta ``metas[j]``; ``path`` laid it out (its ``rows`` builds the alltoall's buffer);
    ``B`` the backend a payload is handed out in.  Indexing and iterating give
    :class:`~.base.Encoded` records, as a list of per-chunk encodings would."""

    __slots__ = ("B", "host", "offs", "nbytes", "metas", "path")

    def __init__(self, B, host, offs, nbytes, metas, path):
        self.B, self.host, self.path = B, host, path
        self.offs = np.asarray(offs, np.int64)
        self.nbytes = np.asarray(nbytes, np.int64)
        self.metas = metas

    def __len__(self) -> int:
        return len(self.metas)

    def __getitem__(self, j: int) -> Encoded:
        a, n = int(self.offs[j]), int(self.nbytes[j])
        return Encoded(self.B.from_host(self.host[a:a + n]), self.metas[j], n)

    def __iter__(self):
        return (self[j] for j in range(len(self)))

    def sent(self, rank: int) -> int:
        """Bytes of every chunk but ``rank``'s (what leaves this rank)."""
        return int(self.nbytes.sum() - self.nbytes[rank])
