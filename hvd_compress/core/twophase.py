"""The two-phase compressed allreduce: bytes per worker that do not grow with the workers.

An allgather of packed payloads hands every worker ``p - 1`` payloads, so its bytes and its
decoding grow with ``p``.  The two-phase exchange keeps both constant in ``p``, as
DeepSpeed's compressed allreduce behind 1-bit Adam does (Tang et al., ICML 2021: all-to-all
of compressed chunks, each owner sums and re-compresses its chunk with its own error
feedback, allgather of the compressed chunks), and as Ok-Topk (Li & Hoefler, PPoPP 2022)
and gTop-k (Shi et al., ICDCS 2019) do for sparse gradients (each worker's selection split
by index range; the owner of a range keeps only the largest of the range's sum).

One tensor of ``n`` values on ``p`` ranks, rank ``r``::

    chunks: np.array_split(range(n), p)         (the first n % p chunks one value longer)
    1. for every chunk j:  e_j = encode(x[chunk j])       state "name#j/p": the worker's
                                                          error feedback, per chunk
       alltoall: e_j goes to its owner, rank j            (a worker sends p - 1 chunks)
    2. owner r:  s_r = aggregate(e_r of ranks 0..p-1)     (their sum, decoded in rank order)
                 o_r = owner.encode(s_r)                  the owner's compressor, error
                                                          feedback always on (its residual
                                                          keeps what the re-encoding drops)
       allgather of the owners' payloads o_0 .. o_{p-1}
    3. result[chunk j] = owner.decode(o_j)                (then averaged as the flat engine)

The owner's compressor (:func:`owner_of`) is the worker's with error feedback on and its own
noise stream (``Compressor.owner_spec``): top-k re-selects the ``ceil(ratio * |chunk|)``
largest of the chunk's sum (what the p workers kept there, up to p times as many); DGC's
owner is error-feedback top-k at DGC's current density (momentum, clipping and masking are
the workers' business).  Nothing is lost: the workers' and owners' residuals plus what was
applied equal the sum of the gradients.  Tensors of two or more axes hand the compressor
each chunk as a column matrix (as the hierarchy's shards), so DGC and 1-bit treat them as
the matrices they are; vectors stay vectors.

Bytes per worker (``C(m)``: a payload of m values): the alltoall moves ``(p-1)/p C(n)`` out
and in, the allgather ``(p-1)/p C(n)``: about ``2 (p-1)/p C(n)`` each way, whatever ``p``
(the account's ``wire_out`` / ``wire_in``, exact).  A worker decodes ``p`` chunks twice (its
own chunk's contributions, then every owner's chunk): ``2 n`` values, not ``p n``.

Summable payloads (``none``, ``fp16``, Random-k, PowerSGD, integer sums) already travel by
an allreduce whose bytes do not grow with ``p``, and a tensor of fewer than ``p`` values
has no chunk for every rank: those go by the flat engine.  Payload sizes that vary with
the values (threshold-v) travel with a header of their int64 lengths.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from . import registry
from .base import Encoded, TensorMeta
from .chunkset import Chunks
from .exchange import Exchange, Runs, _numel, receive_flat
from .layout import column_shape, layout_of

__all__ = ["TwoPhase", "chunk_bounds", "chunk_name", "owner_of", "takes_two_phase"]


def chunk_bounds(n: int, p: int) -> list:
    """``[(start, end)]`` of the ``p`` chunks of ``n`` values (``np.array_split``'s: the first
    ``n % p`` one value longer)."""
    q, extra = divmod(int(n), int(p))
    out, at = [], 0
    for j in range(p):
        size = q + (1 if j < extra else 0)
        out.append((at, at + size))
        at += size
    return out


def chunk_name(name: str, j: int, p: int) -> str:
    """The name chunk ``j`` of ``p`` keys its compressor state (worker's and owner's) by."""
    return f"{name}#{j}/{p}"


def takes_two_phase(comp, shape, p: int) -> bool:
    """Whether a tensor of ``shape`` compressed by ``comp`` goes the two-phase way: packed
    payloads (not summable, not passed through), a chunk for every rank, and the
    compressor does not send it whole (``comp.chunked``)."""
    return p > 1 and not comp.summable and not getattr(comp, "passthrough", False) and \
        _numel(shape) >= p and comp.chunked(shape)


def owner_of(comp):
    """The compressor owners re-encode ``comp``'s chunk sums with (``comp.owner_spec()``),
    made once per spec and kept on ``comp`` (its state is in ``comp``'s checkpoints:
    ``Compressor.state_dict``).  A spec that changes (DGC's warm-up density) makes it anew
    with the state it had.  A framework's compressor that keeps state its own way says
    with ``owner_side()`` (TensorFlow: a child compressor, its state in variables)."""
    side = getattr(comp, "owner_side", None)
    if side is not None:
        return side()
    spec = comp.owner_spec()
    own = comp.__dict__.get("_owner")
    key = str(spec)
    if own is not None and own.__dict__.get("_owner_key") == key and \
            (own.rank, own.world_size) == (comp.rank, comp.world_size):
        return own
    made = registry.build(spec, backend=comp.B, rank=comp.rank, world_size=comp.world_size)
    made.__dict__["_owner_key"] = key
    pending = comp.__dict__.pop("_owner_state", None)
    if own is not None:
        made.load_state_dict(own.state_dict())
    elif pending is not None:
        made.load_state_dict(pending)
    comp.__dict__["_owner"] = made
    return made


def _layouts(states: dict, name: str, p: int) -> dict:
    """``{q: [(j, key)]}``: ``name``'s chunk states under world sizes ``q`` other than ``p``."""
    prefix, out = f"{name}#", {}
    for key in list(states):
        if key.startswith(prefix):
            j, _, q = key[len(prefix):].partition("/")
            if j.isdigit() and q.isdigit() and int(q) != p:
                out.setdefault(int(q), []).append((int(j), key))
    return out


def carried_over(comp, name: str, n: int, p: int, B, like):
    """What tensor ``name``'s chunk states held under another world size (an elastic resize:
    chunks and owners change with ``p``), as one vector of its ``n`` values, those states
    removed -- the workers' (every chunk of theirs) and this rank's owner's; None where there
    are none.  The two-phase exchange puts it back where error feedback keeps what it has
    not sent (``comp.carry_field``), or else into the next input: nothing is lost.  Needs
    the core's states (a framework that keeps them elsewhere carries nothing)."""
    states = getattr(comp, "states", None)
    if not isinstance(states, dict):
        return None
    checked = comp.__dict__.setdefault("_carry_checked", {})  # world size -> names looked at
    if name in checked.setdefault(p, set()):
        return None
    checked[p].add(name)
    own = owner_of(comp)
    found = [(states, _layouts(states, name, p), comp.carry_field),
             (own.states, _layouts(own.states, name, p), own.carry_field)]
    if not any(layouts for _, layouts, _ in found):
        return None
    total = None
    for where, layouts, field in found:
        for q, entries in layouts.items():
            bounds = chunk_bounds(n, q)
            for j, key in entries:
                st = where.pop(key)
                kept = getattr(st, field) if field else None
                if kept is None or j >= len(bounds):
                    continue
                a, b = bounds[j]
                piece = B.concat([B.zeros((a,), "float32", like=like),
                                  B.reshape(B.cast(kept, "float32"), (-1,)),
                                  B.zeros((n - b,), "float32", like=like)])
                total = piece if total is None else total + piece
    return total


class _Part:
    """The two-phase tensors of one batch that one compressor encodes: their worker
    encodings (``encs[i][j]``: tensor i, chunk j), the alltoall in flight, and what the
    owner step and the allgather need."""

    __slots__ = ("comp", "positions", "metas", "bounds", "encs", "handle", "owner", "owned",
                 "gather", "sizes", "free", "names", "shapes", "dtypes", "variable")

    def __init__(self, comp, free: bool, variable: bool):
        self.comp, self.free, self.variable = comp, free, variable
        self.positions, self.metas, self.bounds, self.encs = [], [], [], []
        self.names, self.shapes, self.dtypes = [], [], []
        self.handle = self.owner = self.owned = self.gather = self.sizes = None


class _Batch:
    """One :meth:`TwoPhase.send`: the flat engine's batch and the two-phase parts."""

    def __init__(self, count, flat, flat_at, parts, tag):
        self.count, self.flat, self.flat_at, self.parts, self.tag = count, flat, flat_at, parts, tag


class TwoPhase(Runs):
    """The two-phase exchange over one set of ``p`` ranks (module docstring); the same
    ``send`` / ``receive`` / ``run`` / ``run_each`` / ``agree`` as
    :class:`~.exchange.Exchange`, which it uses for the tensors that do not go this way.

    ``collectives`` needs ``alltoall``; ``comp``, ``average``, ``predivide``, ``op`` as the
    flat engine takes them."""

    def __init__(self, comp, collectives, average: bool = True, predivide: float = 1.0, op=None):
        self.flat = Exchange(comp, collectives, average=average, predivide=predivide, op=op)
        self.coll = collectives
        self.average, self.predivide = average, float(predivide)
        self._laid = {}  # (name, shape, p) -> the chunks' bounds, and their metas once made

    @property
    def comp(self):
        return self.flat.comp

    @comp.setter
    def comp(self, value):
        self.flat.comp = value

    @property
    def agreed(self):
        return self.flat.agreed

    @agreed.setter
    def agreed(self, value):
        self.flat.agreed = value

    @property
    def size(self) -> int:
        return self.coll.size

    def agree(self, plan, key=None) -> None:
        self.flat.agree(plan, key)

    # -- one step ----------------------------------------------------------------------------
    def send(self, tensors, names, stats, tag: str = "", noises=None) -> _Batch:
        """Encode every chunk of the two-phase tensors and start their alltoall (one per
        compressor); the others start in the flat engine."""
        B = self.comp.B
        pick = getattr(self.comp, "pick", None)
        p = self.size
        flat_at, parts = [], {}
        t0 = time.perf_counter()
        for i, (x, name) in enumerate(zip(tensors, names)):
            shape = tuple(B.shape(x))
            comp = self.comp if pick is None else pick(name, shape, B.dtype_name(x))
            n = _numel(shape)
            if not takes_two_phase(comp, shape, p) or self.flat.native(comp):
                flat_at.append(i)
                continue
            part = parts.get(id(comp))
            if part is None:
                part = parts[id(comp)] = _Part(comp, bool(comp.scale_free),
                                               bool(getattr(comp, "variable_size", False)))
            v = B.cast(B.reshape(x, (-1,)), "float32")
            if self.average and self._predivide(comp) != 1.0:
                v = v * (1.0 / self.predivide)
            noise = None if noises is None else noises[i]
            if noise is not None and _numel(B.shape(noise)) != n:
                raise ValueError(f"two-phase exchange: the noise for {name!r} must have one "
                                 f"value per element ({n}), got shape {B.shape(noise)}")
            laid = self._laid.setdefault((name, shape, p), [None, None])
            bounds = laid[0] = laid[0] or chunk_bounds(n, p)
            kept = carried_over(comp, name, n, p, B, v)
            if kept is not None and comp.carry_field is None:  # no residual: the next input
                v, kept = v + kept, None
            encs = self._chunks(comp, v, name, shape, laid) \
                if kept is None and noise is None else None
            if encs is not None:  # every chunk in one call (the backend's chunk path)
                metas = encs.metas
                stats["encode_calls"] += 1
            else:
                metas, encs = self._each_chunk(comp, v, name, shape, bounds, kept, noise, stats)
            stats["tensors"] += 1
            part.positions.append(i)
            part.names.append(name)
            part.shapes.append(shape)
            part.dtypes.append(B.dtype_name(x))
            part.metas.append(metas)
            part.bounds.append(bounds)
            part.encs.append(encs)
        stats["encode_ms"] += (time.perf_counter() - t0) * 1e3
        flat = self.flat.send([tensors[i] for i in flat_at], [names[i] for i in flat_at], stats,
                              tag) if flat_at else None
        for part in parts.values():
            self._start_alltoall(part, tag, stats)
        return _Batch(len(names), flat, flat_at, list(parts.values()), tag)

    def receive(self, batches, stats, outs=None) -> list:
        """Finish ``batches``: every part's owner step and allgather are started before any
        allgather is waited for (a rank blocked in one while another starts a different
        one first would deadlock)."""
        single = isinstance(batches, _Batch)
        batches = [batches] if single else list(batches)
        outs = [None] * len(batches) if outs is None else ([outs] if single else list(outs))
        results = [[None] * b.count for b in batches]
        receive_flat(self.flat, batches, stats, outs, results)
        for b in batches:
            for part in b.parts:
                self._own(part, b.tag, stats)
        for j, b in enumerate(batches):
            for part in b.parts:
                into = [None if outs[j] is None else outs[j][i] for i in part.positions]
                for i, out, value in zip(part.positions, into, self._finish(part, stats, into)):
                    results[j][i] = value if out is None or value is out else \
                        part.comp.B.icopy(out, value)
        return results[0] if single else results

    # -- the phases --------------------------------------------------------------------------
    @staticmethod
    def _path(comp, like, bounds):
        """The backend's chunk path for ``comp``'s chunks ``bounds`` (all of a tensor's in one
        call: :mod:`hvd_compress.accel.host_chunks`), or None: a call a chunk."""
        ask = getattr(comp.B, "chunk_path", None)
        path = None if ask is None else ask(comp, like)
        return path if path is not None and path.takes(comp, bounds) else None

    @staticmethod
    def _each_chunk(comp, v, name, shape, bounds, kept, noise, stats):
        """Every chunk of ``v`` encoded by a call of its own (with ``kept``, what a
        resize carried, put into the chunks' residuals first); their metas and payloads."""
        B, p = comp.B, len(bounds)
        metas, encs = [], []
        for j, (a, b) in enumerate(bounds):
            chunk = v[a:b]
            cshape = column_shape(b - a, layout_of(B)) if len(shape) >= 2 else (b - a,)
            if len(cshape) == 2:
                chunk = B.reshape(chunk, cshape)
            cname = chunk_name(name, j, p)
            if kept is not None:  # into the new chunk's residual (made now if new)
                st = comp.state(comp.meta_for(chunk, cname), like=v)
                field = comp.carry_field
                setattr(st, field, getattr(st, field) + kept[a:b])
            enc = comp.encode(chunk, cname, noise=None if noise is None else
                              B.reshape(noise, (-1,))[a:b])
            metas.append(enc.meta)
            encs.append(enc)
            stats["encode_calls"] += 1
        return metas, encs

    def _chunks(self, comp, v, name, shape, laid):
        """Every chunk of ``v`` encoded in one call where the backend has a chunk path for
        them (the per-chunk calls' bits and states): a :class:`~.chunkset.Chunks`, else
        None.  ``laid``: the chunks' ``[bounds, metas]``, the metas made here once."""
        bounds = laid[0]
        path = self._path(comp, v, bounds)
        if path is None:
            return None
        if laid[1] is None:
            p, layout = len(bounds), layout_of(comp.B)
            shapes = {b - a: column_shape(b - a, layout) if len(shape) >= 2 else (b - a,)
                      for a, b in (bounds[0], bounds[-1])}  # (two lengths at most)
            laid[1] = [TensorMeta(chunk_name(name, j, p), shapes[b - a], "float32")
                       for j, (a, b) in enumerate(bounds)]
        return path.encode(comp, v, name, bounds, laid[1])

    def _rows(self, B, payloads: list, variable: bool, checked: bool = False):
        """One destination's row: the payloads end to end (uint8), headed by their int64
        lengths where sizes vary.  ``checked``: the payloads are known to be flat bytes
        (their tensors' first chunks were checked)."""
        flat = payloads if checked else [B.reshape(q, (-1,)) for q in payloads]
        for q in () if checked else flat:
            if B.dtype_name(q) != "uint8":
                raise TypeError(f"two-phase exchange: payloads must be packed bytes, got "
                                f"{B.dtype_name(q)}")
        if variable:
            head = B.bitcast(B.asarray([B.shape(q)[0] for q in flat], "int64", like=flat[0]),
                             "uint8")
            flat = [head] + flat
        return flat

    def _start_alltoall(self, part: _Part, tag: str, stats) -> None:
        B, p, r = part.comp.B, self.size, self._rank()
        if not part.variable and all(type(e) is Chunks for e in part.encs):
            send, splits = part.encs[0].path.rows(part.encs)  # laid out in one call
            stats["bytes_sent"] += sum(c.sent(r) for c in part.encs)
            stats["wire_out"] += int(splits.sum() - splits[r])
            self._alltoall(part, B.from_host(send), [int(k) for k in splits], tag, stats)
            return
        # every tensor's chunks are alike: its first chunk's payload checked, all flattened
        self._rows(B, [encs[0].payload for encs in part.encs], False)
        payloads = [[e.payload if len(B.shape(e.payload)) == 1 else B.reshape(e.payload, (-1,))
                     for e in encs] for encs in part.encs]
        rows, splits = [], []
        for j in range(p):
            row = self._rows(B, [chunks[j] for chunks in payloads], part.variable, checked=True)
            rows += row
            splits.append(sum(B.shape(q)[0] for q in row))
        # (the chunk this rank owns does not leave it)
        stats["bytes_sent"] += sum(e.nbytes for encs in part.encs for j, e in enumerate(encs)
                                   if j != r)
        stats["wire_out"] += sum(s for j, s in enumerate(splits) if j != r)
        self._alltoall(part, B.concat(rows), splits, tag, stats)

    def _alltoall(self, part: _Part, send, splits, tag: str, stats) -> None:
        stats["collectives"] += 1  # (splits[j] bytes of send to rank j)
        t0 = time.perf_counter()
        part.handle = self.coll.alltoall(send, splits, f"hvd_compress.a2a.{part.names[0]}{tag}")
        stats["comm_ms"] += (time.perf_counter() - t0) * 1e3

    def _split(self, B, row, sizes, variable: bool) -> list:
        """A received row cut into its payloads (one per tensor): by the header where sizes
        vary, else by ``sizes``, the same on every rank (this rank's own payloads')."""
        count = len(sizes)
        if variable:
            sizes = [int(k) for k in B.to_numpy(B.bitcast(row[:8 * count], "int64"))]
            at = 8 * count
        else:
            at = 0
        out = []
        for k in sizes:  # (a traced TensorFlow slice has no static length: give it)
            out.append(B.reshape(row[at:at + k], (k,)))
            at += k
        return out

    def _own(self, part: _Part, tag: str, stats) -> None:
        """Owner step: the alltoall's rows, this rank's chunk of every tensor summed and
        re-encoded, and the allgather of the owners' payloads started."""
        comp, B, p, r = part.comp, part.comp.B, self.size, self._rank()
        own = [encs[r].nbytes for encs in part.encs]  # (every rank's chunk r: these sizes)
        t0 = time.perf_counter()
        got, splits = self._wait_alltoall(part.handle, None if part.variable else [sum(own)] * p)
        part.handle = None
        stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
        stats["wire_in"] += sum(s for q, s in enumerate(splits) if q != r)
        t0 = time.perf_counter()
        mine = [metas[r] for metas in part.metas]
        starts = [0, *itertools.accumulate(splits)][:p]
        sources, sums = None, []
        for i, encs in enumerate(part.encs):
            path = None if part.variable else self._path(comp, got, part.bounds[i])
            if path is not None:  # the p payloads (own[i] bytes each) summed in one call
                sums.append(path.aggregate(comp, got, np.add(starts, sum(own[:i])), mine[i], own[i]))
                stats["decode_calls"] += 1
                continue
            if sources is None:
                sources = [self._split(B, got[a:a + s], own, part.variable)
                           for a, s in zip(starts, splits)]
            sums.append(comp.aggregate([src[i] for src in sources], encs[r]))
            stats["decode_calls"] += p
        stats["decode_ms"] += (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        owner = part.owner = owner_of(comp)
        part.owned = [owner.encode(s, meta.name) for s, meta in zip(sums, mine)]
        stats["encode_calls"] += len(part.owned)
        stats["encode_ms"] += (time.perf_counter() - t0) * 1e3
        row = self._rows(B, [o.payload for o in part.owned], part.variable)
        row = row[0] if len(row) == 1 else B.concat(row)
        n = B.shape(row)[0]
        stats["bytes_sent"] += sum(o.nbytes for o in part.owned)
        stats["wire_out"] += (p - 1) * n
        stats["collectives"] += 1
        t0 = time.perf_counter()
        name = f"hvd_compress.owners.{part.names[0]}{tag}"
        if part.variable:  # the rows' lengths first (8 bytes a rank), as the flat engine
            part.sizes = self.coll.allgather(
                B.bitcast(B.asarray([n], "int64", like=row), "uint8"), name + ".rows")
            stats["bytes_sent"] += 8
            stats["wire_out"] += (p - 1) * 8
            stats["collectives"] += 1
        part.gather = self.coll.allgather(row, name)
        stats["comm_ms"] += (time.perf_counter() - t0) * 1e3

    def _finish(self, part: _Part, stats, outs) -> list:
        """Every owner's chunk decoded into place -- straight into ``outs[i]`` (a gradient
        buffer) where it is float32 host memory -- each tensor averaged and in its shape."""
        B, p, r = part.comp.B, self.size, self._rank()
        t0 = time.perf_counter()
        table = self.coll.wait(part.gather)
        sizes = None if part.sizes is None else self.coll.wait(part.sizes)
        part.gather = part.sizes = None
        stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        owner = part.owner
        if not part.variable and not isinstance(table, (list, tuple)):
            paths = [self._path(owner, table, b) for b in part.bounds]
            if all(paths):  # every tensor's owners' chunks decoded in one call
                out = self._finish_each(part, paths, table, stats, outs)
                part.owned = part.owner = None
                stats["decode_ms"] += (time.perf_counter() - t0) * 1e3
                return out
        if sizes is None:  # every owner's row length, known to all
            sizes = [sum(owner.payload_nbytes(metas[q]) for metas in part.metas) for q in range(p)]
        else:
            sizes = B.concat(list(sizes)) if isinstance(sizes, (list, tuple)) else sizes
            sizes = [int(k) for k in B.to_numpy(B.bitcast(B.reshape(sizes, (-1,)), "int64"))]
            stats["wire_in"] += 8 * (p - 1)
        stats["wire_in"] += sum(k for q, k in enumerate(sizes) if q != r)
        if isinstance(table, (list, tuple)):
            rows = list(table)
        else:
            table = B.reshape(table, (sum(sizes),))
            starts = [0, *itertools.accumulate(sizes)][:p]
            rows = [table[a:a + k] for a, k in zip(starts, sizes)]
        payloads = [self._split(B, rows[q], [owner.payload_nbytes(metas[q])
                                             for metas in part.metas], part.variable)
                    for q in range(p)]
        stats["decode_calls"] += p * len(part.metas)
        out = []
        for i, metas in enumerate(part.metas):
            flat = outs[i] is not None and part.dtypes[i] == "float32" and B.is_host(outs[i])
            flat = B.flat_view(outs[i]) if flat else None
            if flat is not None:  # each chunk decoded (and scaled) in its place
                factor = (1.0 if part.free else self.predivide) / p if self.average else 1.0
                at = 0
                for q in range(p):
                    k = metas[q].numel
                    enc = Encoded(payloads[q][i] if q != r else part.owned[i].payload, metas[q],
                                  0, ctx=None if q != r else part.owned[i].ctx)
                    view = B.reshape(flat[at:at + k], metas[q].shape)
                    owner.aggregate([enc.payload], enc, out=view)
                    if factor != 1.0:
                        owner.scaled(view, [enc.payload], enc, factor)
                    at += k
                out.append(outs[i])
                continue
            pieces = [B.reshape(owner.decode(payloads[q][i], metas[q]), (-1,))
                      if q != r else B.reshape(owner.decode(part.owned[i].payload, metas[q],
                                                            part.owned[i].ctx), (-1,))
                      for q in range(p)]
            dense = B.concat(pieces)
            if self.average:
                factor = (1.0 if part.free else self.predivide) / p
                dense = B.imul(dense, factor) if factor != 1.0 else dense
            dense = B.reshape(dense, part.shapes[i])
            out.append(dense if part.dtypes[i] == "float32" else B.cast(dense, part.dtypes[i]))
        part.owned = part.owner = None
        stats["decode_ms"] += (time.perf_counter() - t0) * 1e3
        return out

    def _finish_each(self, part: _Part, paths, table, stats, outs) -> list:
        """:meth:`_finish` by the chunk paths: each tensor's ``p`` owners' chunks decoded
        (and averaged) into place in one call, the per-chunk calls' bits."""
        B, p, r = part.comp.B, self.size, self._rank()
        lengths = [np.diff([a for a, _ in b] + [b[-1][1]]) for b in part.bounds]
        each = [path.payload_sizes(k) for path, k in zip(paths, lengths)]  # bytes, by owner
        rows = np.sum(each, axis=0)
        stats["wire_in"] += int(rows.sum() - rows[r])
        before = np.concatenate([[0], np.cumsum(rows)[:-1]])
        factor = (1.0 if part.free else self.predivide) / p if self.average else 1.0
        out = []
        for i, path in enumerate(paths):
            into = outs[i] is not None and part.dtypes[i] == "float32" and B.is_host(outs[i])
            flat = B.host_view(B.flat_view(outs[i])) if into else \
                np.empty(int(lengths[i].sum()), np.float32)
            path.decode_into(table, before + sum(each[:i]), lengths[i], flat, factor)
            stats["decode_calls"] += 1
            if into:
                out.append(outs[i])
                continue
            dense = B.reshape(B.from_host(flat), part.shapes[i])
            out.append(dense if part.dtypes[i] == "float32" else B.cast(dense, part.dtypes[i]))
        return out

    def _wait_alltoall(self, handle, known=None):
        """The alltoall's received buffer and how many bytes came from each rank (``known``:
        as every rank's sizes say, so a traced step reads no tensor's value)."""
        out, splits = self.coll.wait(handle)
        B = self.comp.B
        if known is not None:
            splits = known
        elif not isinstance(splits, (list, tuple)):
            splits = [int(k) for k in B.to_numpy(B.reshape(splits, (-1,)))]
        splits = [int(k) for k in splits]
        return B.reshape(out, (sum(splits),)), splits

    def _rank(self) -> int:
        return self.coll.rank

    def _predivide(self, comp) -> float:
        return 1.0 if comp.scale_free else self.predivide


def owner_meta(name: str, numel: int) -> TensorMeta:
    """A chunk's meta as an owner decodes it (for cost estimates: payload sizes)."""
    return TensorMeta(name, (numel,), "float32")


def reference(workers, grads, names, average: bool = True, predivide: float = 1.0) -> list:
    """The two-phase aggregate by its definition, every rank at once (no collectives): the
    numpy reference the engines are checked against.  ``workers``: one compressor per rank
    (rank order; their state, and their owners', advances as the engine's would);
    ``grads[r]``: rank r's tensors, named ``names``.  Returns the averaged (or summed)
    tensors every rank receives.  Every tensor is taken the two-phase way (give it tensors
    that :func:`takes_two_phase` accepts)."""
    p = len(workers)
    B = workers[0].B
    out = []
    for i, name in enumerate(names):
        shape = tuple(B.shape(grads[0][i]))
        n = _numel(shape)
        bounds = chunk_bounds(n, p)
        encs = []
        for r, comp in enumerate(workers):
            v = B.cast(B.reshape(grads[r][i], (-1,)), "float32")
            free = bool(comp.scale_free)
            if average and predivide != 1.0 and not free:
                v = v * (1.0 / predivide)
            row = []
            for j, (a, b) in enumerate(bounds):
                chunk = v[a:b]
                if len(shape) >= 2:
                    chunk = B.reshape(chunk, column_shape(b - a, layout_of(B)))
                row.append(comp.encode(chunk, chunk_name(name, j, p)))
            encs.append(row)
        pieces = []
        for j, comp in enumerate(workers):  # owner j
            total = comp.aggregate([encs[q][j].payload for q in range(p)], encs[j][j])
            owner = owner_of(comp)
            sent = owner.encode(total, encs[j][j].meta.name)
            pieces.append(B.reshape(owner.decode(sent.payload, sent.meta, sent.ctx), (-1,)))
        dense = B.concat(pieces)
        if average:
            dense = dense * ((1.0 if workers[0].scale_free else predivide) / p)
        dense = B.reshape(dense, shape)
        dtype = B.dtype_name(grads[0][i])
        out.append(dense if dtype == "float32" else B.cast(dense, dtype))
    return out
