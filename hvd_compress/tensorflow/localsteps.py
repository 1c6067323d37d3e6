"""Local SGD and Delayed Gradient Averaging for the TF tape and the Keras optimizer.

The rules are :mod:`hvd_compress.localsteps`'; these are their TensorFlow forms,
eager and inside ``tf.function``: strategies around the wrapper's exchange
engine, named as PyTorch's (:mod:`hvd_compress.torch.localsteps`), with
``gradients`` (what to apply this step), ``after_update``, ``average`` and
``drain``.  The step counter, the anchors (parameters
after the last average) and DGA's ring of the last ``D`` local and averaged
gradients are ``tf.Variable``s of the wrapper's state
(:class:`~.wrapperstate.WrapperState`), checkpointed with the compressor.

DGA's collectives: a Horovod TF collective is an op that completes within the
call that runs it.  Eagerly, step i's exchange therefore runs on a background
thread (one per compressor, so exchanges keep their order) and is waited for at
step i + D: it overlaps the next D steps' compute, as in PyTorch.  Inside a
``tf.function`` (Keras ``fit``) a step cannot leave an op running past its
end: step i's collective runs during step i, overlapping only that step's
update, and the average waits in a ring of variables until step i + D.
The state passed around is the wrapper's (:func:`~.wrapperstate.wrapper_state`).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import tensorflow as tf

from ..core.stats import Stats
from .exchange import variable_name


def strategy(session, state, buffers=()):
    """The :class:`LocalSGD` or :class:`DelayedAveraging` that ``session`` (its schedule,
    its delay) asks for around its current engine, keeping its counter and variables in
    ``state`` (the wrapper's), or None (synchronous)."""
    if session.schedule is not None:
        return LocalSGD(session, state, buffers)
    if session.delay:
        return DelayedAveraging(session, state)
    return None


def accumulate(state, grads, names, passes: int, exchange):
    """``backward_passes_per_step`` for the tape: sum ``grads`` locally into ``state``'s
    sums; every ``passes``-th call ``exchange(sums)`` and return the averages, zeros in
    between.  Returns ``(results, exchanged)`` (``exchanged``: a bool eagerly, a boolean
    tensor when traced)."""
    accs = [state.sum(name, g) for g, name in zip(grads, names)]
    updates = [acc.assign_add(g) for acc, g in zip(accs, grads)]
    with tf.control_dependencies(updates):
        count = state.passes.assign_add(1)
    do = tf.equal(count % passes, 0)

    def sync():
        outs = exchange([acc.read_value() for acc in accs])
        with tf.control_dependencies(outs):
            resets = [acc.assign(tf.zeros_like(acc)) for acc in accs]
        with tf.control_dependencies(resets):
            return [tf.identity(o) for o in outs]

    def skip():
        return [tf.zeros_like(g) for g in grads]

    if tf.executing_eagerly():
        did = bool(do)
        return (sync() if did else skip()), did
    return tf.cond(do, sync, skip), do


class _Strategy:
    """What both strategies share: the session, its engine and compressor, and the
    wrapper's state (``state.local_steps``: the optimizer steps taken)."""

    def __init__(self, session, state):
        self.session = session
        self.engine = session.engine
        self.comp = self.engine.comp
        self.state = state

    def counter(self):
        """Optimizer steps taken (a variable of the wrapper's state)."""
        return self.state.local_steps

    def after_update(self, variables, names, stats):
        return tf.constant(False)

    def drain(self):
        pass


class LocalSGD(_Strategy):
    """Local steps; every ``period`` of them (after ``warmup`` synchronous ones) the
    workers average their variables -- compressed, their change since the anchors --
    and their floating-point ``buffers``."""

    def __init__(self, session, state, buffers=()):
        super().__init__(session, state)
        self.schedule = session.schedule
        self.buffers = list(buffers)

    @tf.autograph.experimental.do_not_convert
    def gradients(self, grads, variables, names, stats):
        """What the optimizer should apply this step, from the local ``grads``."""
        step = self.counter().read_value()
        if not self.comp.passthrough:  # compressed: anchors = where the local phase starts
            anchors = self._anchors(variables, names)
            _when(tf.equal(step, self.schedule.warmup),
                  lambda: [a.assign(tf.convert_to_tensor(v)) for a, v in zip(anchors, variables)])
        if self.schedule.warmup == 0:
            return list(grads)

        def sync():
            return self.engine.run_each(grads, names, stats)

        # (eagerly, tf.cond is a Python branch)
        return tf.cond(self.schedule.synchronous(step), sync, lambda: [tf.identity(g) for g in grads])

    def _anchors(self, variables, names):
        return [self.state.anchor(n, v) for v, n in zip(variables, names)]

    @tf.autograph.experimental.do_not_convert
    def after_update(self, variables, names, stats):
        """Count the step; average the parameters when the schedule says so.  Returns
        whether it averaged (a boolean tensor)."""
        counter = self.counter()
        step = counter.read_value()
        did = _when(self.schedule.averages_after(step),
                    lambda: self.average(variables, names, stats))
        with tf.control_dependencies([did]):
            counter.assign_add(1)
        return did

    def average(self, variables, names, stats):
        """Average ``variables`` (and the float buffers) over the ranks now."""
        if self.comp.passthrough:  # the exact mean of the parameters
            self._average_in_place(variables, names, stats)
        else:  # the mean change since the anchors, through the compressor
            anchors = self._anchors(variables, names)
            deltas = self.engine.run_each(
                [tf.convert_to_tensor(v) - a for v, a in zip(variables, anchors)],
                [f"{n}/delta" for n in names], stats)
            for v, a, delta in zip(variables, anchors, deltas):
                a.assign_add(delta)
                v.assign(a.read_value())
        floats = [b for b in self.buffers
                  if tf.as_dtype(b.dtype).is_floating and b.shape.num_elements() != 0]
        self._average_in_place(floats, [variable_name(b) for b in floats], stats)
        return tf.constant(True)

    def _average_in_place(self, variables, names, stats):
        """``variables`` replaced by their mean over the ranks, uncompressed."""
        from .compressors import TFCompressor
        dense = self.session.dense_engine(lambda: TFCompressor("none"))
        means = dense.run_each([tf.convert_to_tensor(v) for v in variables],
                               [f"local.{n}" for n in names], stats)
        for v, mean in zip(variables, means):
            v.assign(mean)


class DelayedAveraging(_Strategy):
    """DGA: step i's gradients are sent at once and their average is applied at step
    i + D, as ``g_i - g_{i-D} + avg(g_{i-D})`` (the local gradient for i < D)."""

    def __init__(self, session, state):
        super().__init__(session, state)
        self.delay = session.delay

    @tf.autograph.experimental.do_not_convert
    def gradients(self, grads, variables, names, stats):
        """What the optimizer should apply this step, from the local ``grads``."""
        if tf.executing_eagerly():
            return self._eager(grads, names, stats)
        D = self.delay
        counter = self.counter()
        step = counter.read_value()
        slot = tf.cast(step % D, tf.int32)
        late = step >= D
        out = []
        for g, name in zip(grads, names):
            local_ring, avg_ring = self.state.ring(name, g, D)
            old_local = tf.gather(local_ring, slot)
            old_avg = tf.gather(avg_ring, slot)
            corrected = tf.where(late, g - old_local + old_avg, g)
            (avg,) = self.engine.run_each([g], [name], stats)
            with tf.control_dependencies([corrected]):
                local_ring.scatter_nd_update([[slot]], g[None])
                avg_ring.scatter_nd_update([[slot]], avg[None])
            out.append(corrected)
        with tf.control_dependencies(out):
            counter.assign_add(1)
        return out

    def _eager(self, grads, names, stats):
        """Eagerly: the exchange of step i runs on the wrapper state's exchange thread and
        is collected at step i + D (tensors are immutable: no copies needed)."""
        ring = self._in_flight()
        grads = list(grads)
        fn, sent = self._traced_exchange(tuple(names))
        inflight = ring.inflight.setdefault(tuple(names), deque())  # per set of tensors
        inflight.append((ring.thread.submit(fn, grads), grads))
        self.counter().assign_add(1)
        if len(inflight) <= self.delay:
            return grads
        future, old = inflight.popleft()
        t0 = time.perf_counter()
        avgs = future.result()
        waited = (time.perf_counter() - t0) * 1e3
        stats.bytes_sent += sent.bytes_sent
        stats.collectives += sent.collectives
        stats.comm_ms += waited  # what this step waited for, not the thread's time
        return [g - o + a for g, o, a in zip(grads, old, avgs)]

    def _traced_exchange(self, names):
        """The exchange of gradients ``names`` as a ``tf.function``: eager Horovod ops all
        carry one name (their op type), so two could not be in flight at once; traced
        ones carry ours.  Returns the function and the bytes/collectives one call sends."""
        fns = self._in_flight().fns
        e = self.engine
        key = (names, id(e.comp), e.average, e.predivide, e.op, id(e.coll.process_set))
        if key not in fns:
            sent = Stats()

            @tf.function
            def exchange(grads):
                sent.bytes_sent = sent.collectives = 0  # (what the trace counts)
                return self.engine.run_each(grads, names, sent, tag=".dga")

            fns[key] = (exchange, sent)
        return fns[key]

    def drain(self):
        """Wait for the exchanges still running on the exchange thread (their averages
        are not applied)."""
        ring = self.state.in_flight
        for inflight in (ring.inflight if ring is not None else {}).values():
            while inflight:
                inflight.popleft()[0].result()

    def _in_flight(self) -> "_EagerRing":
        """The wrapper state's exchanges in flight (a tape is made anew every step, the
        state is not)."""
        if self.state.in_flight is None:
            self.state.in_flight = _EagerRing()
        return self.state.in_flight


class _EagerRing:
    """Eager DGA's exchanges in flight for one wrapper state: its thread (exchanges keep
    their order), the futures per set of tensors, the traced exchanges."""

    def __init__(self):
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="hvdc-dga")
        self.inflight = {}
        self.fns = {}


def _when(condition, fn):
    """Run ``fn`` if ``condition`` holds (eagerly tf.cond is a Python branch).  Returns
    whether it ran, as a boolean tensor."""
    def run():
        with tf.control_dependencies(tf.nest.flatten(fn())):
            return tf.constant(True)

    return tf.cond(condition, run, lambda: tf.constant(False))

