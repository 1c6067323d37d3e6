"""``torch.distributed``'s collectives as the exchange engine takes them (no Horovod).

What the DDP communication hook (:mod:`.ddp`) lends :class:`~hvd_compress.core.exchange.
Exchange` and :class:`~hvd_compress.core.twophase.TwoPhase`: the same protocol the
Horovod optimizer runs, over any ``torch.distributed`` process group (Gloo, NCCL, MPI).
Allreduces and allgathers are started with ``async_op=True`` and finished in :meth:`wait`.
``all_gather`` needs rows of one size, so an allgather first gathers every rank's row
length (one int64 each), pads its row to the longest and cuts the rows apart on
receipt; an alltoall sends its split sizes first (``all_to_all_single`` of one int64 per
rank), then the data.

Tensors travel on a device the group's backend takes and come back on their own: NCCL
moves CUDA tensors only (the plan agreement's bytes, made on the host, go by the current
GPU), Gloo has no all-to-all for CUDA tensors and MPI none for any (they go by host
memory there).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.exchange import MAX, Collectives

__all__ = ["TorchDistributed"]


class TorchDistributed(Collectives):
    """Collectives over the ``torch.distributed`` process group ``group`` (None: the
    default group).  Tensors stay on their device (CPU for Gloo, CUDA for NCCL).
    ``sums_bfloat16`` is False as for Horovod's collectives, so bfloat16 payloads travel
    as float16 and the bits match the Horovod path whatever the backend."""

    sums_bfloat16 = False

    def __init__(self, group=None):
        self.group = group
        self._backend = None

    def _wire(self, x, alltoall: bool = False):
        """``x`` on a device this group's backend moves it on."""
        if self._backend is None:
            self._backend = str(dist.get_backend(self.group)).lower()
        if self._backend == "nccl":
            return x if x.is_cuda else x.to(torch.device("cuda", torch.cuda.current_device()))
        if x.device.type != "cpu" and (alltoall or self._backend != "gloo"):
            return x.cpu()
        return x

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def allreduce(self, flat, name, op=None, prescale=1.0, postscale=1.0):
        """The sum (or, ``op`` :data:`MAX`, the maximum) over ranks of a copy of ``flat``
        (the engine may hand in a tensor it still reads, e.g. a gradient)."""
        wire = self._wire(flat)
        out = (wire.clone() if wire is flat else wire) if prescale == 1.0 else wire * prescale
        red = dist.ReduceOp.MAX if op == MAX else dist.ReduceOp.SUM
        work = dist.all_reduce(out, op=red, group=self.group, async_op=True)
        return _Reduced(work, out, postscale, home=flat.device)

    def allgather(self, flat, name):
        """Every rank's ``flat`` (lengths may differ), as a list of rows in rank order."""
        home = flat.device
        flat = self._wire(flat.reshape(-1))
        lengths = self._lengths(flat.shape[0], flat.device)
        longest = max(lengths)
        row = flat if flat.shape[0] == longest else torch.cat(
            [flat, flat.new_zeros(longest - flat.shape[0])])
        rows = [torch.empty_like(row) for _ in lengths]
        work = dist.all_gather(rows, row.contiguous(), group=self.group, async_op=True)
        return _Gathered(work, rows, lengths, home)

    def reducescatter(self, flat, name):
        """The sum over ranks, of which this rank keeps the ``rank``-th of ``size`` equal
        parts (``reduce_scatter_tensor`` on NCCL; Gloo has none: an allreduce, sliced)."""
        p, r = self.size, self.rank
        k = flat.shape[0] // p
        home, flat = flat.device, self._wire(flat)
        if self._backend == "nccl":
            out = flat.new_empty(k)
            work = dist.reduce_scatter_tensor(out, flat.contiguous(), group=self.group,
                                              async_op=True)
            return _Reduced(work, out, 1.0, home=home)
        out = flat.clone()
        work = dist.all_reduce(out, group=self.group, async_op=True)
        return _Reduced(work, out, 1.0, part=(r * k, (r + 1) * k), home=home)

    def alltoall(self, flat, splits, name):
        """``flat``'s pieces of ``splits[j]`` elements to rank ``j``; :meth:`wait` gives
        ``(received, received_splits)``."""
        splits = [int(k) for k in splits]
        home, flat = flat.device, self._wire(flat, alltoall=True)
        sizes = torch.tensor(splits, dtype=torch.int64, device=flat.device)
        got = torch.empty_like(sizes)
        dist.all_to_all_single(got, sizes, group=self.group)
        received = [int(k) for k in got.tolist()]
        out = flat.new_empty(sum(received))
        work = dist.all_to_all_single(out, flat.contiguous(), received, splits,
                                      group=self.group, async_op=True)
        return _Exchanged(work, out, received, home)

    def wait(self, handle):
        return handle.result() if isinstance(handle, _Handle) else handle

    def _lengths(self, n: int, device) -> list:
        """Every rank's row length ``n``, in rank order (one small all_gather)."""
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        return [int(x) for x in torch.cat(every).tolist()]


class _Handle:
    def __init__(self, work):
        self.work = work

    def result(self):
        self.work.wait()
        return self._value()


class _Reduced(_Handle):
    def __init__(self, work, out, postscale, part=None, home=None):
        super().__init__(work)
        self.out, self.postscale, self.part, self.home = out, postscale, part, home

    def _value(self):
        out = self.out if self.postscale == 1.0 else self.out.mul_(self.postscale)
        out = out if self.part is None else out[self.part[0]:self.part[1]]
        return out.to(self.home)


class _Gathered(_Handle):
    def __init__(self, work, rows, lengths, home):
        super().__init__(work)
        self.rows, self.lengths, self.home = rows, lengths, home

    def _value(self):
        return [row[:n].to(self.home) for row, n in zip(self.rows, self.lengths)]


class _Exchanged(_Handle):
    def __init__(self, work, out, splits, home):
        super().__init__(work)
        self.out, self.splits, self.home = out, splits, home

    def _value(self):
        return self.out.to(self.home), self.splits
