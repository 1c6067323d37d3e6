"""One gradient through compression and Horovod's collectives, for the TF tape and Keras.

``GradientExchange.one(grad, name, stats)`` encodes ``grad`` with the
compressor's per-tensor state, runs PowerSGD's extra rounds, sends the payload
with ``allreduce`` (summable) or ``allgather`` (packed bytes, fixed size per
rank), aggregates, and averages over the ranks (``op=Average``, with
``gradient_predivide_factor`` split before and after as Horovod does).  Works
eagerly and inside ``tf.function``; ``stats`` collects bytes sent and, eagerly,
milliseconds.
"""

from __future__ import annotations

import time

import horovod.tensorflow as hvd
import tensorflow as tf

from .compressors import _safe, wire


def variable_name(var, default: str = "") -> str:
    """The name a variable's compressor state and collectives are keyed by: Keras 3's
    unique ``.path`` (its ``.name`` is short, "kernel"), else the ``tf.Variable`` name."""
    return getattr(var, "path", None) or getattr(var, "name", None) or default


class GradientExchange:
    def __init__(self, compression, op=hvd.Average, gradient_predivide_factor=1.0,
                 process_set=hvd.global_process_set):
        self.compression = compression
        self.op = op
        self.predivide = gradient_predivide_factor
        self.process_set = process_set

    @tf.autograph.experimental.do_not_convert
    def one(self, grad, name, stats, suffix=""):
        """``suffix`` sets the collectives' names apart from other exchanges of ``name``
        that may run at the same time (DGA's exchange thread)."""
        comp = self.compression
        size = self.process_set.size()
        tag = _safe(name) + suffix
        if self.op == hvd.Average and self.predivide != 1.0:
            grad = grad * (1.0 / self.predivide)
        t0 = time.perf_counter()
        enc = comp.encode(grad, name)
        stats["encode_ms"] += (time.perf_counter() - t0) * 1e3
        for _ in range(comp.rounds(enc.meta) - 1):
            t0 = time.perf_counter()
            reduced = hvd.allreduce(enc.payload, op=hvd.Sum, name=f"hvdc.{tag}.{enc.round}",
                                    process_set=self.process_set)
            stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
            stats["bytes_sent"] += enc.nbytes
            stats["collectives"] += 1
            enc = comp.next_round(enc, reduced)
        t0 = time.perf_counter()
        if comp.summable:
            received = hvd.allreduce(wire(enc.payload), op=hvd.Sum, name=f"hvdc.{tag}.{enc.round}",
                                     process_set=self.process_set)
            if received.dtype != enc.payload.dtype and enc.payload.dtype != tf.int16:
                received = tf.cast(received, enc.payload.dtype)
        else:
            gathered = hvd.allgather(enc.payload, name=f"hvdc.{tag}.{enc.round}",
                                     process_set=self.process_set)
            rows = tf.reshape(gathered, [size, enc.nbytes])  # static: payload sizes are
            received = [rows[r] for r in range(size)]
        stats["comm_ms"] += (time.perf_counter() - t0) * 1e3
        stats["bytes_sent"] += enc.nbytes
        stats["collectives"] += 1
        t0 = time.perf_counter()
        total = comp.aggregate(received, enc)
        if self.op == hvd.Average:
            total = total * tf.cast(self.predivide / size, total.dtype)
        stats["decode_ms"] += (time.perf_counter() - t0) * 1e3
        return total
