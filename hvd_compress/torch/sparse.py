"""Sparse gradients (``nn.Embedding(..., sparse=True)``) in our optimizer, as in Horovod's.

Sent uncompressed (``none``, without ``sparse_as_dense``), a sparse gradient
goes by Horovod's own sparse allreduce -- an allgather of every rank's indices
and of its values, divided by the number of ranks for ``op=Average`` -- and
the result is a sparse tensor (duplicate indices left for the optimizer to sum),
exactly what ``horovod.torch.DistributedOptimizer`` hands the wrapped optimizer.
A compressor works on dense tensors: the gradient is densified first (the
memory of one dense copy of the parameter per step), compressed and exchanged,
and the average goes back into the sparse ``p.grad``.
"""

from __future__ import annotations

import horovod.torch as hvd

from ..core.base import warn_once

__all__ = ["SparseAware", "densify"]


def densify(grad, name: str, compressed: bool):
    """The dense form of sparse ``grad`` (warns once per tensor when a compressor is why)."""
    if compressed:
        warn_once(f"densify-{name}",
                  f"parameter {name!r} has a sparse gradient: it is made dense "
                  f"({grad.numel():,} elements) to be compressed; with compression='none' "
                  "it goes sparse, by Horovod's sparse allreduce")
    return grad.to_dense()


class _Mixed:
    """A batch in flight whose sparse tensors went by Horovod's sparse allreduce."""

    def __init__(self, batch, dense_at, handles, count):
        self.batch, self.dense_at, self.handles, self.count = batch, dense_at, handles, count


class SparseAware:
    """The exchange engine, with sparse tensors sent as Horovod sends them (module
    docstring); everything else (``comp``, ``send``/``receive`` of dense tensors) is the
    engine's."""

    def __init__(self, engine, process_set, op):
        self.engine, self.process_set, self.op = engine, process_set, op

    @property
    def comp(self):
        return self.engine.comp

    @comp.setter
    def comp(self, value):
        self.engine.comp = value

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def send(self, tensors, names, stats, tag=""):
        sparse = [i for i, t in enumerate(tensors) if t.is_sparse]
        if not sparse:
            return self.engine.send(tensors, names, stats, tag)
        dense_at = [i for i, t in enumerate(tensors) if not t.is_sparse]
        batch = self.engine.send([tensors[i] for i in dense_at], [names[i] for i in dense_at],
                                 stats, tag) if dense_at else None
        handles = {}
        for i in sparse:
            t = tensors[i]  # as Horovod: not coalesced (duplicates summed by the optimizer)
            handles[i] = hvd.sparse_allreduce_async(t, name=f"hvd_compress.{names[i]}{tag}",
                                                    op=self.op, process_set=self.process_set)
            stats["bytes_sent"] += t._indices().numel() * t._indices().element_size() + \
                t._values().numel() * t._values().element_size()
            stats["collectives"] += 2
        return _Mixed(batch, dense_at, handles, len(tensors))

    def receive(self, batches, stats, outs=None):
        single = not isinstance(batches, (list, tuple))
        batches = [batches] if single else list(batches)
        outs = [None] * len(batches) if outs is None else ([outs] if single else outs)
        inner, inner_outs = [], []
        for b, o in zip(batches, outs):
            if isinstance(b, _Mixed):
                if b.batch is not None:
                    inner.append(b.batch)
                    inner_outs.append(None if o is None else [o[i] for i in b.dense_at])
            else:
                inner.append(b)
                inner_outs.append(o)
        received = iter(self.engine.receive(inner, stats, inner_outs) if inner else [])
        results = []
        for b in batches:
            if not isinstance(b, _Mixed):
                results.append(next(received))
                continue
            res = [None] * b.count
            if b.batch is not None:
                for i, r in zip(b.dense_at, next(received)):
                    res[i] = r
            for i, handle in b.handles.items():
                res[i] = handle()
            results.append(res)
        return results[0] if single else results
