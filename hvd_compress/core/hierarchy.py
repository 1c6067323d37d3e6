"""The hierarchical exchange: dense inside a node, compressed only between nodes.

Workers that share a node talk over fast links; the links between nodes are the slow
ones.  With ``N`` nodes of ``L`` workers each, a compressor whose payloads travel by
allgather (top-k, DGC, QSGD, 1-bit, ...) exchanges a gradient ``x`` so:

1. **inside the node**, one reduce-scatter (over the node's process set) sums the
   workers' gradients dense: the worker of local index ``l`` holds shard ``l`` of its
   node's sum (each tensor flattened and padded with zeros to a multiple of ``L``, its
   shards ``ceil(n/L)`` values long);
2. **between nodes**, that worker compresses its shard -- the compressor's state keyed by
   the tensor's name and the shard (``name@l/L``), so error feedback keeps what each
   shard did not send -- and the exchange engine sends it only to the workers of local
   index ``l`` on the other nodes (the *cross* process set, ``N`` workers): each gets the
   sum over nodes of the decoded shards;
3. **inside the node**, one allgather puts the shards together on every worker.

With ``between=TwoPhase`` step 2 is the two-phase exchange among the ``N`` nodes
(:mod:`.twophase`): a worker then receives about ``2 (N-1)/N`` of a shard's payload
rather than ``N - 1`` payloads.

The aggregate is therefore, by definition, ``sum over nodes of decode(compress(shard of
the node's sum))``; with op=Average it is divided by ``p = N * L``.  The bytes on the links
between nodes fall by ``L`` (a worker sends the payload of ``1/L`` of each tensor, and
receives ``N - 1`` of them rather than ``p - 1``), and so does decoding.  Shards are
vectors: a tensor of two or more dimensions hands its shard to the compressor as a
``(ceil(n/L), 1)`` matrix (``(1, ceil(n/L))`` in TensorFlow's layout), so that DGC still
compresses it (1-bit's column means are then one per shard).

Which tensors go this way: those whose compressor sends packed bytes by allgather,
and the integer sums (``terngrad:sum=int``, ...), whose allreduce between nodes then
moves the same bytes a node as the flat one but each worker encodes and decodes
``1/L`` of a tensor (their lanes stay as wide as the whole world needs: a compressor
is built for ``p`` workers).  Other summable payloads (``none``, ``fp16``, Random-k,
PowerSGD) travel by one allreduce whose ring moves ``2 (p-1)/p`` of a payload
whatever the layout, at no cost to encode; they go by the flat engine over all
workers, exactly as without hierarchy.
``gradient_predivide_factor`` ``f`` divides the gradients before the reduce-scatter and
multiplies the result by ``f / p``, as the flat engine does.

Framework-neutral: a framework lends three :class:`~.exchange.Collectives` (all workers,
the node's, the cross set) of which the node's has ``reducescatter``.
"""

from __future__ import annotations

import time

from .exchange import Exchange, Runs, _numel, receive_flat
from .layout import column_shape, layout_of

__all__ = ["Hierarchical", "shard_name", "shard_length", "sharded"]


def sharded(comp) -> bool:
    """Whether a compressor's tensors take the hierarchical exchange: payloads gathered,
    or integer codes summed (each worker then encodes only its shard)."""
    return not comp.summable or bool(comp.integer_sum)


def shard_length(numel: int, local_size: int) -> int:
    """Values in each worker's shard of a tensor of ``numel`` values: ``ceil(numel / L)``."""
    return -(-numel // local_size)


def shard_name(name: str, local_index: int, local_size: int) -> str:
    """The name a shard's compressor state and collectives are keyed by."""
    return f"{name}@{local_index}/{local_size}"


class _Batch:
    """One :meth:`Hierarchical.send`: the flat engine's batch (summable tensors) and the
    node's reduce-scatter in flight (compressed ones)."""

    def __init__(self, count, flat, flat_at, sharded_at, shapes, names, handle, tag, dtypes,
                 widths, free):
        self.count, self.flat, self.flat_at = count, flat, flat_at
        self.sharded_at, self.shapes, self.names = sharded_at, shapes, names
        self.handle, self.tag, self.dtypes = handle, tag, dtypes
        self.widths = widths  # each sharded tensor's shard length
        self.free = free  # each sharded tensor's compressor's ``scale_free``


class Hierarchical(Runs):
    """The exchange over ``N`` nodes of ``L`` workers; see the module docstring.

    ``comp``: a compressor or a per-tensor router (as :class:`~.exchange.Exchange`
    takes); ``world``, ``node``, ``cross``: the Collectives over all workers, this
    worker's node (with ``reducescatter``) and its cross set; ``local_index``: this
    worker's rank within its node's set; ``between``: the engine class among the nodes
    (the flat one, or :class:`~.twophase.TwoPhase`: hierarchical + two-phase).
    ``send``/``receive``/``run``/``run_each``/``agree`` as the flat engine's."""

    def __init__(self, comp, world, node, cross, local_index: int, average: bool = True,
                 predivide: float = 1.0, op=None, between=Exchange):
        self.flat = Exchange(comp, world, average=average, predivide=predivide, op=op)
        self.between = between(comp, cross, average=False)
        self.between.agreed = self.flat.agreed
        self.node, self.local_index = node, int(local_index)
        self.average, self.predivide = average, float(predivide)

    # -- what the wrappers read and set ------------------------------------------------------
    @property
    def comp(self):
        return self.flat.comp

    @comp.setter
    def comp(self, value):
        self.flat.comp = self.between.comp = value

    @property
    def agreed(self):
        return self.flat.agreed

    @agreed.setter
    def agreed(self, value):
        self.flat.agreed = self.between.agreed = value

    @property
    def size(self) -> int:
        return self.flat.size

    @property
    def local_size(self) -> int:
        return self.node.size

    def agree(self, plan, key=None) -> None:
        self.flat.agree(plan, key)

    # -- one step ----------------------------------------------------------------------------
    def send(self, tensors, names, stats: dict, tag: str = "", noises=None) -> _Batch:
        B = self.comp.B
        pick = getattr(self.comp, "pick", None)
        flat_at, sharded_at, free = [], [], []
        for i, (x, name) in enumerate(zip(tensors, names)):
            comp = self.comp if pick is None else pick(name, B.shape(x), B.dtype_name(x))
            if sharded(comp):
                sharded_at.append(i)
                free.append(bool(comp.scale_free))
            else:
                flat_at.append(i)
        flat = self.flat.send([tensors[i] for i in flat_at], [names[i] for i in flat_at], stats,
                              tag) if flat_at else None
        handle = None
        L = self.local_size
        widths = [shard_length(_numel(B.shape(tensors[i])), L) for i in sharded_at]
        if sharded_at:
            t0 = time.perf_counter()
            rows = []
            for i, k in zip(sharded_at, widths):  # each tensor as L rows of its shard length
                x = B.reshape(B.cast(tensors[i], "float32"), (-1,))
                if self.average and self.predivide != 1.0:
                    x = x * (1.0 / self.predivide)
                rows.append(B.reshape(B.pad_to(x, k * L), (L, k)))
            # row i of the buffer: shard i of every tensor, in order
            buf = B.reshape(rows[0], (-1,)) if len(rows) == 1 else \
                B.concat([r[i] for i in range(L) for r in rows])
            handle = self.node.reducescatter(buf, f"hvd_compress.node.{names[sharded_at[0]]}{tag}")
            stats["local_bytes"] += 4 * B.shape(buf)[0] * (L - 1) // L
            stats["collectives"] += 1
            stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
        return _Batch(len(names), flat, flat_at, sharded_at,
                      [B.shape(tensors[i]) for i in sharded_at], [names[i] for i in sharded_at],
                      handle, tag, [B.dtype_name(tensors[i]) for i in sharded_at], widths, free)

    def receive(self, batches, stats: dict, outs=None) -> list:
        single = isinstance(batches, _Batch)
        batches = [batches] if single else list(batches)
        outs = [None] * len(batches) if outs is None else ([outs] if single else list(outs))
        results = [[None] * b.count for b in batches]
        receive_flat(self.flat, batches, stats, outs, results)  # the summable tensors
        # the sharded ones: the node's sums, then every batch's cross exchange, then the
        # node's allgathers (all started before any is waited for)
        sharded = [(j, b) for j, b in enumerate(batches) if b.handle is not None]
        if not sharded:
            return results[0] if single else results
        B = self.comp.B
        L, li = self.local_size, self.local_index
        cross = []
        for j, b in sharded:
            t0 = time.perf_counter()
            # (a traced TensorFlow collective's result has no static length: give it)
            mine = B.reshape(self.node.wait(b.handle), (sum(b.widths),))
            stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
            shards, names, at = [], [], 0
            for shape, name, k in zip(b.shapes, b.names, b.widths):
                part = mine[at:at + k]
                at += k
                shards.append(B.reshape(part, column_shape(k, layout_of(B))) if len(shape) >= 2 else part)
                names.append(shard_name(name, li, L))
            cross.append(self.between.send(shards, names, stats, b.tag))
        summed = self.between.receive(cross, stats)
        gathers = []
        for (j, b), parts in zip(sharded, summed):
            t0 = time.perf_counter()
            row = B.concat([B.reshape(p, (-1,)) for p in parts]) if len(parts) > 1 else \
                B.reshape(parts[0], (-1,))
            gathers.append(self.node.allgather(row, f"hvd_compress.node.{b.names[0]}{b.tag}.all"))
            stats["local_bytes"] += 4 * B.shape(row)[0] * (L - 1)
            stats["collectives"] += 1
            stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
        for (j, b), handle in zip(sharded, gathers):
            t0 = time.perf_counter()
            table = self.node.wait(handle)
            stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            table = B.reshape(B.concat(list(table)) if isinstance(table, (list, tuple)) else table,
                              (L, sum(b.widths)))
            at = 0
            whole = B.reshape(table, (-1,)) if len(b.shapes) == 1 else None  # (no copy)
            for i, shape, dtype, k, free in zip(b.sharded_at, b.shapes, b.dtypes, b.widths, b.free):
                n = _numel(shape)
                # (a majority vote does not scale with its inputs: no predivide to undo)
                scale = (1.0 if free else self.predivide) / self.size if self.average else 1.0
                dense = whole[:n] if whole is not None else \
                    B.reshape(table[:, at:at + k], (-1,))[:n]
                at += k
                # the gathered table is this exchange's own: scaled in place
                dense = B.reshape(B.imul(dense, scale) if scale != 1.0 else dense, shape)
                dense = dense if dtype == "float32" else B.cast(dense, dtype)
                out = None if outs[j] is None else outs[j][i]
                results[j][i] = dense if out is None else B.icopy(out, dense)
            stats["decode_ms"] += (time.perf_counter() - t0) * 1e3
        return results[0] if single else results

