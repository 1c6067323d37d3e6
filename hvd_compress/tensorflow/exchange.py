"""Horovod's TensorFlow collectives as the exchange engine takes them, the names that
key a variable's compressor state and collectives, and the tape's and Keras
optimizer's :class:`~hvd_compress.session.Session` (:func:`session`).

A Horovod TF collective completes inside the op that runs it, eagerly or in a
``tf.function``: :meth:`HorovodTF.allreduce` returns the result itself or a handle
it holds, and the first :meth:`HorovodTF.wait` runs the allreduces held so far
together (one grouped op).  Op names must be valid TF op names, so collective names
are sanitised here.
"""

from __future__ import annotations

import threading
import weakref

import horovod.tensorflow as hvd
import tensorflow as tf

from ..core import agreement
from ..core.exchange import MAX, Exchange, ProcessSetCollectives
from ..core.hierarchy import Hierarchical
from ..core.routed import Routed
from ..core.twophase import TwoPhase
from ..session import Session


def variable_name(var, default: str = "") -> str:
    """The name a variable's compressor state and collectives are keyed by: Keras 3's
    unique ``.path`` (its ``.name`` is short, "kernel"), else the ``tf.Variable`` name."""
    return getattr(var, "path", None) or getattr(var, "name", None) or default


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


class _Deferred:
    """An allreduce not yet run (:meth:`HorovodTF.allreduce`)."""

    __slots__ = ("flat", "name", "op", "scales", "where", "result")

    def __init__(self, flat, name, op, scales, where):
        self.flat, self.name, self.op, self.scales = flat, name, op, scales
        self.where, self.result = where, None  # (see _context)


class HorovodTF(ProcessSetCollectives):
    """``hvd.allreduce`` / ``hvd.allgather`` over ``process_set``.

    Horovod negotiates each allreduce in its background thread's cycles (every 1 ms by
    default): eagerly an allreduce blocks through its own cycle, so an exchange of n
    tensors costs n; inside a ``tf.function`` the gradients' allreduces become ready
    one by one during the backward pass and often take two cycles or more.  So the
    allreduces an exchange starts are held (:class:`_Deferred`) until it first waits on
    one, then go as one ``hvd.grouped_allreduce`` per op, scales and dtype: one
    negotiation, one fused buffer (Horovod's own tape with ``num_groups=1``; measured on
    the digits CNN at np 2, about 1 ms of a 9 ms traced step).  Held only where the
    grouped sum is bit for bit the one-by-one sum (:meth:`_groupable`).  Every rank
    starts and waits in the same order, so every rank groups alike; held allreduces
    are kept per thread and graph (eager DGA traces its exchange on a thread of its
    own), and a wait runs those of its own."""

    def __init__(self, process_set):
        super().__init__(process_set)
        self._deferred = {}  # (thread, graph or None when eager) -> [_Deferred]

    def allreduce(self, flat, name, op=None, prescale=1.0, postscale=1.0):
        op = hvd.Sum if op is None else hvd.Max if op == MAX else op
        if self._groupable(op, flat.dtype):
            handle = _Deferred(flat, name, op, (prescale, postscale), _context())
            self._deferred.setdefault(handle.where, []).append(handle)
            return handle
        return hvd.allreduce(flat, op=op, name=safe_name(name),
                             prescale_factor=prescale, postscale_factor=postscale,
                             process_set=self.process_set)

    def _groupable(self, op, dtype) -> bool:
        """Whether one grouped allreduce gives each element the bits its own would: a
        maximum or minimum, an integer sum, or a float sum over two ranks (a + b = b + a).
        Over more, Gloo's ring adds an element's terms in an order that follows its place
        in the fused buffer (measured: last-bit differences at 3 and 4 ranks)."""
        if op in (hvd.Max, hvd.Min):
            return True
        return op in (hvd.Sum, hvd.Average) and (self.size <= 2 or tf.as_dtype(dtype).is_integer)

    def wait(self, handle):
        if not isinstance(handle, _Deferred):
            return handle
        if handle.result is None:
            self._run_deferred(handle.where)
        return handle.result

    def _run_deferred(self, where) -> None:
        """Run the allreduces held in thread and graph ``where``: one
        ``hvd.grouped_allreduce`` per op, scales and dtype (a lone one as a plain
        allreduce), in the order they were started."""
        groups = {}
        for h in self._deferred.pop(where, []):
            groups.setdefault((h.op, h.scales, h.flat.dtype), []).append(h)
        for (op, (pre, post), _), hs in groups.items():
            if len(hs) == 1:
                hs[0].result = hvd.allreduce(hs[0].flat, op=op, name=safe_name(hs[0].name),
                                             prescale_factor=pre, postscale_factor=post,
                                             process_set=self.process_set)
                continue
            out = hvd.grouped_allreduce([h.flat for h in hs], op=op,
                                        name=safe_name(hs[0].name) + f".group{len(hs)}",
                                        prescale_factor=pre, postscale_factor=post,
                                        process_set=self.process_set)
            for h, r in zip(hs, out):
                h.result = r

    def allgather(self, flat, name):
        return hvd.allgather(flat, name=safe_name(name), process_set=self.process_set)

    def alltoall(self, flat, splits, name):
        return hvd.alltoall(flat, splits=tf.constant(splits, dtype=tf.int32), name=safe_name(name),
                            process_set=self.process_set)

    def reducescatter(self, flat, name):
        """Horovod's reduce-scatter on GPUs; elsewhere an allreduce of which this rank keeps
        its part (the Gloo reduce-scatter was measured slower than the allreduce: see
        :meth:`hvd_compress.torch.collectives.HorovodTorch.reducescatter`)."""
        if "GPU" in (flat.device or ""):
            return hvd.reducescatter(flat, op=hvd.Sum, name=safe_name(name),
                                     process_set=self.process_set)
        total = hvd.allreduce(flat, op=hvd.Sum, name=safe_name(name), process_set=self.process_set)
        k = int(flat.shape[0]) // self.size
        r = self.process_set.rank()
        return total[r * k:(r + 1) * k]

    def eager(self):
        """Out of a ``tf.function`` being traced: the plan check runs once, at trace time
        (every rank traces at its first call), not in every step's graph."""
        return tf.init_scope()


def _context() -> tuple:
    """Where an op made now lands: this thread, and the graph being built (None eagerly)."""
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    return threading.get_ident(), graph


_plain = tf.autograph.experimental.do_not_convert


class TFExchange(Exchange):
    """The engine, run as plain Python inside ``tf.function`` (AutoGraph leaves it be:
    its loops are over Python lists, its branches on Python values)."""

    send = _plain(lambda self, tensors, names, *args, **kwargs: (
        _eager_sizes(self, tensors, names), Exchange.send(self, tensors, names, *args, **kwargs))[1])
    receive = _plain(Exchange.receive)
    run = _plain(Exchange.run)
    run_each = _plain(Exchange.run_each)


class TFHierarchical(Hierarchical):
    """The hierarchical exchange (:mod:`hvd_compress.core.hierarchy`), run as plain Python
    inside ``tf.function`` as :class:`TFExchange` is."""

    send = _plain(lambda self, tensors, names, *args, **kwargs: (
        _eager_sizes(self, tensors, names),
        Hierarchical.send(self, tensors, names, *args, **kwargs))[1])
    receive = _plain(Hierarchical.receive)
    run = _plain(Hierarchical.run)
    run_each = _plain(Hierarchical.run_each)


class TFTwoPhase(TwoPhase):
    """The two-phase exchange (:mod:`hvd_compress.core.twophase`), run as plain Python inside
    ``tf.function`` as :class:`TFExchange` is."""

    send = _plain(lambda self, tensors, names, *args, **kwargs: (
        _eager_sizes(self, tensors, names), TwoPhase.send(self, tensors, names, *args, **kwargs))[1])
    receive = _plain(TwoPhase.receive)
    run = _plain(TwoPhase.run)
    run_each = _plain(TwoPhase.run_each)


class TFRouted(Routed):
    """Tensors routed to several engines (``exchange="auto"``: :mod:`hvd_compress.core.routed`),
    run as plain Python inside ``tf.function``."""

    send = _plain(Routed.send)
    receive = _plain(Routed.receive)
    run = _plain(Routed.run)
    run_each = _plain(Routed.run_each)


def _eager_sizes(engine, tensors, names) -> None:
    """Payloads of data-dependent size (threshold-v, adaptive quantization) need their
    lengths in Python: such compressors run eagerly, not inside ``tf.function``."""
    if tf.executing_eagerly():
        return
    pick = getattr(engine.comp, "pick", None)
    for x, n in zip(tensors, names):
        comp = engine.comp if pick is None else pick(n, tuple(x.shape), tf.as_dtype(x.dtype).name)
        if getattr(comp, "variable_size", False):
            raise NotImplementedError(
                f"{comp.spec}: its payload size depends on the values, which a traced "
                "TensorFlow step cannot size; run the step eagerly (Keras: "
                "model.compile(..., run_eagerly=True); a tape: outside tf.function)")


#: the plans each compressor's ranks agreed on: a tape is made anew every step, the
#: compressor (and the state it holds for the variables) is not
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: what exchange="auto" measured and chose for each compressor (for the same reason)
_KNOWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def session(op=hvd.Average, gradient_predivide_factor=1.0, process_set=hvd.global_process_set,
            hierarchical=None, local_sgd=False, period=1, warmup=0, delay=0,
            exchange="auto") -> Session:
    """The session of a tape or Keras optimizer: the engine (:class:`TFExchange`, or
    :class:`TFHierarchical` where the node process sets are registered; ``hierarchical``
    as :func:`hvd_compress.torch.DistributedOptimizer`'s) is made by :func:`bind`."""
    return Session(hvd, process_set, HorovodTF, op=op, predivide=gradient_predivide_factor,
                   hierarchical=hierarchical, exchange=exchange, flat=TFExchange,
                   tiered=TFHierarchical, twophase=TFTwoPhase, routed=TFRouted,
                   local_sgd=local_sgd, period=period, warmup=warmup, delay=delay)


def bind(s: Session, compression):
    """``s``'s engine for ``compression`` (a TFCompressor or TFPolicy, whose methods bind
    its variables as the core's state), sharing the plans agreed with that compressor."""
    return s.make_engine(compression, agreed=_AGREED.setdefault(compression, set()),
                         known=_KNOWN.setdefault(compression, {}))


def describe(x) -> tuple:
    """A tensor's ``(shape, dtype name)`` as a per-tensor policy takes them."""
    return tuple(x.shape), tf.as_dtype(x.dtype).name


def plan_rows(comp, variables) -> list:
    """Per variable: name, shape, dtype, compressor (once compression runs) and payload
    bytes per step (see :meth:`hvd_compress.pertensor.PolicyFrontend.plan`)."""
    return comp.plan([(variable_name(v), tuple(int(d) for d in v.shape), _dtype(v))
                      for v in variables])


def plan(wrapper: str, comp, op, gradient_predivide_factor, backward_passes_per_step,
         grads, names, local_sgd=False, warmup=0, delay=0, buffers=(), **more) -> dict:
    """The exchange plan of a tape or Keras optimizer (see :mod:`hvd_compress.core.agreement`):
    ``grads`` with their ``names``, as exchanged."""
    if hasattr(comp, "policy"):  # each tensor's own compressor
        more["plan"] = [str(comp.spec_for(n, tuple(_shape(g)), _dtype(g), dense=False))
                        for g, n in zip(grads, names)]
    return agreement.plan(
        wrapper, comp.describe(), agreement.op_name(op, hvd), gradient_predivide_factor,
        backward_passes_per_step, [(n, _shape(g), _dtype(g)) for g, n in zip(grads, names)],
        local_sgd=agreement.local_sgd(local_sgd, backward_passes_per_step, warmup),
        delay=int(delay), buffers=[[variable_name(b), _shape(b), _dtype(b)] for b in buffers], **more)


def _shape(x) -> list:
    shape = tf.TensorShape(x.shape)
    return shape.as_list() if shape.rank is not None else [None]


def _dtype(x) -> str:
    return tf.as_dtype(x.dtype).name  # Keras 3 variables' dtype is a string
