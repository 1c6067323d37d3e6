"""The exchange engine: the protocol that moves a list of gradients, written once.

Every path that sends tensors -- the PyTorch optimizer, the Horovod-contract
``compress()``/``decompress()`` of both frameworks, the TensorFlow tape and
Keras optimizer, local SGD and DGA, and :mod:`hvd_compress.tools.mpi_check` -- runs this code.
A framework supplies only its array backend (``comp.B``) and its collectives
(a :class:`Collectives`: Horovod's ``allreduce``/``allgather`` on its tensors
for one process set, or mpi4py's).

One exchange of tensors ``x_1 .. x_n`` named ``n_1 .. n_n`` on ``p`` ranks::

    x_i <- x_i / f                          (op=Average, gradient_predivide_factor f;
                                             f = 1 for the majority vote: scale-free)
    enc_i = comp.encode(x_i, n_i)           (state: residuals, DGC memory, PowerSGD Q)
    # tensors that need the same number of rounds share one collective per round
    for each extra round (PowerSGD; the     payloads laid end to end, allreduce-sum
      integer-summed quantizers' scales):   (max where comp.round_op(r) is MAX),
        enc_i = comp.next_round(enc_i, sum_i)
    final round: summable payloads          -> one allreduce-sum
                 packed bytes               -> one allgather (each rank's row)
                 sizes that vary (threshold-v) -> the rows' lengths (one allgather of
                                               8 bytes) and the rows, each headed by
                                               its payloads' int64 lengths (both
                                               started at once, read on receipt)
    y_i = comp.aggregate(received_i, enc_i) (dense sum over ranks, decoded into
                                             ``out_i`` where given)
    y_i <- y_i * f / p                      (op=Average)

``none`` given the user's ``op`` is Horovod's own: the collective reduces
(``op``, prescale ``1/f``, postscale ``f``) and nothing is decoded, so the
result is bit for bit what Horovod's ``DistributedOptimizer`` computes.  The account adds to a
:class:`~.stats.Stats` (:func:`new_stats`): the bytes this rank sends (every round), the
collectives started, and encode / communicate / decode milliseconds.

:meth:`Exchange.send` starts the collectives and returns a :class:`Batch`;
:meth:`Exchange.receive` finishes one or several batches (their extra rounds
interleaved, so the collectives of many groups stay in flight together).
Horovod's TensorFlow collectives complete inside the call that starts them; the
engine does not care.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

from . import agreement
from .stats import Stats, new_stats

__all__ = ["Collectives", "ProcessSetCollectives", "Loopback", "Exchange", "Batch", "Stats",
           "new_stats", "MAX", "Runs", "receive_flat"]

#: the ``op`` of an extra round whose payloads combine by element-wise maximum (the
#: scales integer-summed quantizers share, :mod:`.intsum`); every Collectives honours it
MAX = "max"


class Collectives:
    """What a framework lends the engine: collectives over one process set.

    ``allreduce(flat, name, op=None, prescale=1.0, postscale=1.0)`` starts a sum
    over ranks (``op`` None), an element-wise maximum (``op`` :data:`MAX`) or, for
    uncompressed tensors, the reduction the user asked for (an opaque Horovod op);
    ``allgather(flat, name)`` starts the
    concatenation of every rank's ``flat`` in rank order.  Both return a handle
    that :meth:`wait` turns into the result (for an allgather, the flat
    concatenation or the list of the ranks' rows).  ``sums_bfloat16``: whether the
    allreduce can add bfloat16 (Horovod 0.28.1 cannot: bf16 payloads then travel
    as float16, exact within float16's range)."""

    size = 1
    rank = 0
    sums_bfloat16 = False

    def allreduce(self, flat, name: str, op=None, prescale: float = 1.0, postscale: float = 1.0):
        raise NotImplementedError

    def allgather(self, flat, name: str):
        raise NotImplementedError

    def reducescatter(self, flat, name: str):
        """Starts the sum over ranks of ``flat`` (its length a multiple of ``size``), of which
        rank ``r`` receives the ``r``-th of ``size`` equal parts (the hierarchical exchange,
        inside a node)."""
        raise NotImplementedError

    def alltoall(self, flat, splits, name: str):
        """Starts the exchange in which ``flat``'s consecutive pieces of ``splits[j]``
        elements go to rank ``j``; :meth:`wait` gives ``(received, received_splits)``: what
        came, in rank order, and how much from each rank (the two-phase exchange)."""
        raise NotImplementedError

    def wait(self, handle):
        return handle

    def eager(self):
        """A context in which collectives run now (TensorFlow: out of a graph being traced)."""
        return nullcontext()


class ProcessSetCollectives(Collectives):
    """Collectives over a Horovod process set (any framework's): its size is the set's."""

    def __init__(self, process_set):
        self.process_set = process_set

    @property
    def size(self) -> int:
        return self.process_set.size()

    @property
    def rank(self) -> int:
        return self.process_set.rank()


class Loopback(Collectives):
    """One rank talking to itself: what a single process (or a test) exchanges."""

    sums_bfloat16 = True  # nothing is added

    def allreduce(self, flat, name, op=None, prescale=1.0, postscale=1.0):
        return flat if prescale * postscale == 1.0 else flat * (prescale * postscale)

    def allgather(self, flat, name):
        return flat

    def reducescatter(self, flat, name):
        return flat

    def alltoall(self, flat, splits, name):
        return flat, list(splits)


class Runs:
    """What every engine builds on its ``send`` and ``receive`` (the flat one, the
    hierarchical, two-phase and routed ones): one exchange, and one collective per tensor."""

    def run(self, tensors, names, stats: dict, tag: str = "", outs=None) -> list:
        """:meth:`send` then :meth:`receive`: the averaged (or summed) tensors."""
        return self.receive(self.send(tensors, names, stats, tag), stats, outs)

    def run_each(self, tensors, names, stats: dict, tag: str = "", outs=None) -> list:
        """Like :meth:`run`, each tensor in a collective of its own (all in flight at
        once): for tensors whose dtypes differ, or to keep collectives per variable."""
        batches = [self.send([x], [n], stats, tag) for x, n in zip(tensors, names)]
        results = self.receive(batches, stats, None if outs is None else [[o] for o in outs])
        return [r for (r,) in results]


def receive_flat(flat, batches, stats, outs, results) -> None:
    """Finish the flat engine's part of ``batches`` (each with ``flat``: its batch or None,
    ``flat_at``: its tensors' positions) all at once, into ``results`` (and ``outs``): what
    the hierarchical and two-phase engines leave to the flat one."""
    sent = [(j, b) for j, b in enumerate(batches) if b.flat is not None]
    if not sent:
        return
    got = flat.receive([b.flat for _, b in sent], stats,
                       [None if outs[j] is None else [outs[j][i] for i in b.flat_at]
                        for j, b in sent])
    for (j, b), res in zip(sent, got):
        for i, r in zip(b.flat_at, res):
            results[j][i] = r


class _Part:
    """Tensors of a batch that travel in one collective per round: one compressor's
    (``comp``), needing the same number of rounds, with payloads of one dtype."""

    __slots__ = ("positions", "encs", "rounds", "tag", "final", "handle", "shapes", "comp",
                 "native", "sizes")

    def __init__(self, positions, encs, rounds, tag, final, comp, native):
        self.positions, self.encs, self.rounds = positions, encs, rounds
        self.tag, self.final = tag, final
        self.comp, self.native = comp, native
        self.handle = self.shapes = self.sizes = None  # sizes: the row lengths' handle

    @property
    def round(self) -> int:
        return self.encs[0].round

    @property
    def more(self) -> bool:
        """Whether a round other than the last is in flight."""
        return self.round < self.rounds - 1


class Batch:
    """Collectives in flight for one :meth:`Exchange.send`; :attr:`encoded` holds
    each tensor's latest :class:`~.base.Encoded` (its final round once received)."""

    def __init__(self, parts, count: int):
        self.parts, self.count = parts, count

    @property
    def encoded(self) -> list:
        out = [None] * self.count
        for part in self.parts:
            for i, enc in zip(part.positions, part.encs):
                out[i] = enc
        return out


class Exchange(Runs):
    """The protocol for lists of tensors; see the module docstring.

    ``comp`` is a compressor (core, or a framework wrapper that binds its state)
    with ``B``, ``summable``, ``passthrough``, ``rounds``, ``encode``,
    ``next_round``, ``aggregate`` and ``wire`` -- or a per-tensor policy's router
    (:mod:`.policy`) with ``B`` and ``pick(name, shape, dtype)``, which returns
    each tensor's compressor.  ``average``: op=Average (the
    result is the mean over ranks); ``predivide``: Horovod's
    ``gradient_predivide_factor``; ``op``: the user's op, handed to the
    collective for uncompressed tensors."""

    def __init__(self, comp, collectives: Collectives, average: bool = True,
                 predivide: float = 1.0, op=None):
        self.comp = comp
        self.coll = collectives
        self.average = average
        self.predivide = float(predivide)
        self.op = op
        #: the plans the ranks agreed on (:meth:`agree`); a wrapper may share one set
        self.agreed = set()

    @property
    def size(self) -> int:
        return self.coll.size

    # -- one step --------------------------------------------------------------------------
    def send(self, tensors, names, stats: dict, tag: str = "", final: bool = True,
             noises=None) -> Batch:
        """Encode ``tensors`` and start their collectives.  ``tag`` sets the collective
        names apart from other exchanges of the same tensors in flight; ``final=False``
        leaves the last round to the caller (Horovod's own optimizer); ``noises``
        (optional, one per tensor) is the stochastic rounding's noise."""
        B = self.comp.B
        pick = getattr(self.comp, "pick", None)
        t0 = time.perf_counter()
        groups: dict[tuple, tuple] = {}
        for i, (x, name) in enumerate(zip(tensors, names)):
            comp = self.comp if pick is None else pick(name, B.shape(x), B.dtype_name(x))
            if comp.max_ranks is not None and self.size > comp.max_ranks:
                raise ValueError(f"{comp.spec}: its integer sums hold at most {comp.max_ranks} "
                                 f"ranks, but {self.size} take part; build it with the "
                                 "world size it runs at")
            native = self.native(comp)
            if self.average and self._predivide(comp) != 1.0 and not native:
                x = x * (1.0 / self.predivide)
            enc = comp.encode(x, name, noise=None if noises is None else noises[i])
            if not getattr(comp, "passthrough", False):
                stats["encode_calls"] += 1
                stats["tensors"] += 1
            rounds = comp.rounds(enc.meta)
            key = (id(comp), rounds, B.dtype_name(enc.payload) if comp.summable else "")
            _, _, positions, encs = groups.setdefault(key, (comp, rounds, [], []))
            positions.append(i)
            encs.append(enc)
        stats["encode_ms"] += (time.perf_counter() - t0) * 1e3
        parts = [_Part(pos, encs, rounds, tag, final, comp, self.native(comp))
                 for comp, rounds, pos, encs in groups.values()]
        for part in parts:
            if part.more or final:
                self._start(part, stats)
        return Batch(parts, len(names))

    def receive(self, batches, stats: dict, outs=None) -> list:
        """Finish ``batches`` (a :class:`Batch` or a list of them); returns, per batch,
        the list of results in the order they were sent (a single batch: its list).
        ``outs`` (same nesting, entries may be None) receive the results in place."""
        single = isinstance(batches, Batch)
        batches = [batches] if single else list(batches)
        if outs is None:
            outs = [None] * len(batches)
        elif single:
            outs = [outs]
        self._rounds([part for batch in batches for part in batch.parts], stats)
        results = []
        for batch, out in zip(batches, outs):
            result = [None] * batch.count
            for part in batch.parts:
                received = self._wait(part, stats)
                t0 = time.perf_counter()
                for i, enc, got in zip(part.positions, part.encs, received):
                    result[i] = self._finish(part, got, enc, None if out is None else out[i])
                    if not getattr(part.comp, "passthrough", False):
                        stats["decode_calls"] += len(got) if isinstance(got, (list, tuple)) else 1
                stats["decode_ms"] += (time.perf_counter() - t0) * 1e3
            results.append(result)
        return results[0] if single else results

    def native(self, comp) -> bool:
        """Uncompressed with the user's op: the collective reduces (Horovod's own way)."""
        return bool(getattr(comp, "passthrough", False)) and self.op is not None

    def agree(self, plan, key=None) -> None:
        """Check that every rank holds ``plan`` (a dict, or a callable making one; see
        :mod:`.agreement`) before a set-up's first exchange: one small allgather, once
        per ``key`` (default: the plan's fingerprint, so a new set of tensors is checked
        again).  Raises :class:`~.agreement.PlanMismatchError` on every rank."""
        if key is not None and key in self.agreed:
            return
        p = plan() if callable(plan) else plan
        key = agreement.fingerprint(p) if key is None else key
        if key in self.agreed:
            return
        if self.size > 1:
            with self.coll.eager():
                agreement.check(p, lambda data, lengths: agreement.gather_bytes(
                    self.coll, self.comp.B, data, lengths))
        self.agreed.add(key)

    # -- Horovod's contract (its optimizer runs the final collective) ---------------------
    def prepare(self, tensor, name: str):
        """Encode ``tensor`` and run its extra rounds; the returned
        :class:`~.base.Encoded`'s payload, :meth:`wired`, is what Horovod's own
        allreduce carries, and ``comp.aggregate`` of the result decodes it."""
        stats = new_stats()
        batch = self.send([tensor], [name], stats, final=False)
        self._rounds(batch.parts, stats)
        return batch.encoded[0]

    def wired(self, payload, comp=None):
        """A summable payload as the allreduce can carry it."""
        return payload if self.coll.sums_bfloat16 else (comp or self.comp).wire(payload)

    # -- internals -------------------------------------------------------------------------
    def _rounds(self, parts, stats: dict) -> None:
        """Extra rounds (PowerSGD): finish round r of every part, then start its r + 1."""
        while True:
            more = [part for part in parts if part.more]
            if not more:
                return
            for part in more:
                reduced = self._wait(part, stats)
                t0 = time.perf_counter()
                part.encs = [part.comp.next_round(e, r) for e, r in zip(part.encs, reduced)]
                stats["encode_ms"] += (time.perf_counter() - t0) * 1e3
                if part.more or part.final:
                    self._start(part, stats)

    def _start(self, part: _Part, stats: dict) -> None:
        comp = part.comp
        B = comp.B
        summable = comp.summable
        payloads = [self.wired(e.payload, comp) if summable else e.payload for e in part.encs]
        part.shapes = [B.shape(p) for p in payloads]
        if len(payloads) > 1:
            flat = B.concat([B.reshape(p, (-1,)) for p in payloads])
        else:  # one payload, flat already: as it is (an eager op fewer per tensor)
            flat = payloads[0] if len(part.shapes[0]) == 1 else B.reshape(payloads[0], (-1,))
        name = f"hvd_compress.{part.encs[0].meta.name}.{part.round}{part.tag}"
        sent = sum(e.nbytes for e in part.encs)
        stats["bytes_sent"] += sent
        stats["collectives"] += 1
        p = self.size
        if part.native or summable or part.more:  # a ring allreduce
            stats["wire_out"] += 2 * (p - 1) * sent // p
            stats["wire_in"] += 2 * (p - 1) * sent // p
        elif not getattr(comp, "variable_size", False):  # rows of one size on every rank
            stats["wire_out"] += (p - 1) * sent
            stats["wire_in"] += (p - 1) * sent
        t0 = time.perf_counter()
        if part.native:  # exactly what Horovod's own optimizer does
            pre, post = (1.0 / self.predivide, self.predivide) if self.average else (1.0, 1.0)
            part.handle = self.coll.allreduce(flat, name, op=self.op, prescale=pre, postscale=post)
        elif summable or part.more:
            part.handle = self.coll.allreduce(flat, name, op=comp.round_op(part.round))
        elif getattr(comp, "variable_size", False):
            part.handle = self._start_rows(part, payloads, name, stats)
        else:
            part.handle = self.coll.allgather(flat, name)
        stats["comm_ms"] += (time.perf_counter() - t0) * 1e3

    def _start_rows(self, part: _Part, payloads, name: str, stats: dict):
        """Payloads whose sizes vary by rank: this rank's row is the payloads' int64
        lengths (a payload may pass 2 GiB: a 600M-element INCEPTIONN tensor) then the
        payloads.  Two allgathers start, neither waited for here (a
        rank blocked in one group's send while another rank sends a different group
        first would deadlock): every rank's row length (8 bytes; :meth:`_wait` reads them
        to tell the rows apart) and the rows (an allgather takes rows of different
        lengths)."""
        B = part.comp.B
        lengths = [B.shape(p)[0] for p in payloads]
        head = B.bitcast(B.asarray(lengths, "int64", like=payloads[0]), "uint8")
        row = B.concat([head] + [B.reshape(p, (-1,)) for p in payloads])
        size = B.bitcast(B.asarray([B.shape(row)[0]], "int64", like=row), "uint8")
        part.sizes = self.coll.allgather(size, name + ".rows")
        stats["bytes_sent"] += B.shape(head)[0] + 8  # the header and the row length
        stats["wire_out"] += (self.size - 1) * (B.shape(row)[0] + 8)
        stats["collectives"] += 1
        return self.coll.allgather(row, name)

    def _wait(self, part: _Part, stats: dict) -> list:
        """The received payload of each tensor of ``part`` (allgather: a list per tensor,
        one payload per rank in rank order)."""
        B = part.comp.B
        t0 = time.perf_counter()
        out = self.coll.wait(part.handle)
        sizes = None if part.sizes is None else self.coll.wait(part.sizes)
        part.handle = part.sizes = None
        stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
        if sizes is not None:
            return self._split_rows(part, out, sizes, stats)
        offsets = [0]
        for shape in part.shapes:
            offsets.append(offsets[-1] + _numel(shape))
        spans = list(zip(offsets, offsets[1:]))
        if part.comp.summable or part.more:
            if len(part.shapes) == 1 and len(part.shapes[0]) == 1 and \
                    _shape_of(B, out) == part.shapes[0]:
                return [out]  # one flat payload: the collective's result is it (no slice)
            return [B.reshape(out[a:b], shape) for (a, b), shape in zip(spans, part.shapes)]
        if isinstance(out, (list, tuple)):  # the collectives split the ranks' rows already
            rows = out
        else:
            table = B.reshape(out, (self.size, offsets[-1]))
            rows = [table[r] for r in range(self.size)]
        return [[row[a:b] for row in rows] for a, b in spans]

    def _split_rows(self, part: _Part, out, sizes, stats: dict) -> list:
        """Rows of different lengths (see :meth:`_start_rows`; ``sizes``: the gathered
        row lengths) into each tensor's list of payloads, one per rank in rank order."""
        B = part.comp.B
        if not isinstance(out, (list, tuple)):  # one buffer: cut at the gathered lengths
            sizes = B.concat(list(sizes)) if isinstance(sizes, (list, tuple)) else sizes
            sizes = [int(n) for n in B.to_numpy(B.bitcast(B.reshape(sizes, (-1,)), "int64"))]
            out = B.reshape(out, (-1,))
            starts = [sum(sizes[:r]) for r in range(len(sizes))]
            out = [out[a:a + n] for a, n in zip(starts, sizes)]
        stats["wire_in"] += sum(B.shape(row)[0] + 8 for r, row in enumerate(out)
                                if r != self.coll.rank)
        count = len(part.encs)
        per_tensor = [[] for _ in range(count)]
        for row in out:
            lengths = [int(n) for n in B.to_numpy(B.bitcast(row[:8 * count], "int64"))]
            at = 8 * count
            for i, n in enumerate(lengths):
                per_tensor[i].append(row[at:at + n])
                at += n
        return per_tensor

    def _finish(self, part, got, enc, out):
        comp = part.comp
        B = comp.B
        if part.native:  # the collective reduced as the user's op says
            result = B.reshape(got, enc.meta.shape)
            return result if out is None else B.icopy(out, result)
        result = comp.aggregate(got, enc, out=out)
        if self.average:  # the aggregate is a fresh tensor (or ``out``): scaled in place
            result = comp.scaled(result, got, enc, self._predivide(comp) / self.size)
        return result

    def _predivide(self, comp) -> float:
        """``gradient_predivide_factor`` for ``comp``'s tensors: 1 for a compressor whose
        aggregate does not scale with its inputs (the majority vote: dividing the
        inputs by f would leave the vote as it is, and the postscale would multiply it
        by f)."""
        return 1.0 if comp.scale_free else self.predivide


def _shape_of(B, x):
    """``x``'s shape, or None where a traced tensor's is not fully known."""
    try:
        return tuple(B.shape(x))
    except (TypeError, ValueError):
        return None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
