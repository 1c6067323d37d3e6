"""Horovod's PyTorch collectives as the exchange engine takes them (async handles)."""

from __future__ import annotations

import horovod.torch as hvd

from ..core.exchange import MAX, ProcessSetCollectives


class HorovodTorch(ProcessSetCollectives):
    """``allreduce_async`` / ``allgather_async`` over ``process_set``; :meth:`wait` is
    ``hvd.synchronize``.  Tensors stay where they are (CPU or CUDA)."""

    def allreduce(self, flat, name, op=None, prescale=1.0, postscale=1.0):
        op = hvd.Sum if op is None else hvd.Max if op == MAX else op
        return hvd.allreduce_async(flat, name=name, op=op,
                                   prescale_factor=prescale, postscale_factor=postscale,
                                   process_set=self.process_set)

    def allgather(self, flat, name):
        return hvd.allgather_async(flat, name=name, process_set=self.process_set)

    def reducescatter(self, flat, name):
        return hvd.reducescatter_async(flat, name=name, op=hvd.Sum, process_set=self.process_set)

    def wait(self, handle):
        return hvd.synchronize(handle)
