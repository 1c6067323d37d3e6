"""Adam with compressed communication: 1-bit Adam and 0/1 Adam, framework-neutral.

**1-bit Adam** (Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam:
Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021).
Adam's variance becomes stable early; once it is frozen, Adam is a momentum SGD with a
fixed per-coordinate step size, and momentum tolerates error-compensated compression::

    t <= freeze_step (warm-up):  g = avg_r(g_r)                    dense allreduce
                                 m = b1 m + (1 - b1) g
                                 v = b2 v + (1 - b2) g*g
    t >  freeze_step:            m = b1 m + (1 - b1) g_r           the worker's own gradient
                                 m = C(m)                          compressed average, error
                                                                   feedback on both sides
    p = p - lr (m' / (sqrt(v') + eps) + wd p)

**0/1 Adam** (Lu, Li, Zhang, De Sa, He, "Maximizing Communication Efficiency for
Large-scale Training via 0/1 Adam", ICLR 2023).  The variance is updated only at steps
whose spacing doubles (``var_update_scaler`` updates per spacing, kappa in the paper)
until ``var_freeze_step``; in between the gradient travels compressed.  After the
variance froze, workers take local steps and sync the accumulated update, whose spacing
doubles every ``local_step_scaler`` steps up to ``local_step_clipper`` (H)::

    t <= var_freeze_step:  t % var_interval == 0:  dense g, m and v updated
                           otherwise:              m = b1 m + (1 - b1) C(g_r), v kept
                           p = p - lr d,  d = m' / (sqrt(v') + eps) + wd p
    t >  var_freeze_step:  m = b1 m + (1 - b1) g_r;  p = p - lr d;  u = u - lr d;  lrs += lr
                           t % local_interval == 0 (sync):
                               p = p - u                   (back to where the ranks agreed)
                               u = C(u * (sqrt(v') + eps)) (compressed average)
                               m = -u / lrs                (the momentum the ranks agree on)
                               p = p + u / (sqrt(v') + eps);  u = 0;  lrs = 0

Error feedback restarts (zero residuals) when 0/1 Adam enters its local steps: the
residuals of gradients do not belong to the accumulated updates.  Semantics follow
DeepSpeed's ``onebit/adam.py`` and ``onebit/zoadam.py``, with three differences, all
said here: DeepSpeed's first step only allocates buffers (ours is a step); its
``bias_correction`` is accepted but not applied (ours: ``m' = m / (1 - b1^t)``, ``v' = v
/ (1 - b2^k)``, ``k`` the variance updates so far; ``bias_correction=False`` is
DeepSpeed's update); its compressed allreduce scales a worker's whole tensor by one
factor (ours: the compressor's, per two-phase chunk).

The arithmetic is written once, below, on arrays of any backend with the operators ``+ -
*`` and ``/`` between arrays, ``B.sqrt`` (in float64) and ``B.cast``; scalars are Python
floats (a float32 array times a Python float is the same float32 product in numpy and
torch), and no division by a scalar (torch multiplies by its reciprocal): numpy and
torch give the same bits. :func:`reference` runs whole trainings of every rank at once
on numpy (the paper's update, with :func:`.twophase.reference` for the compressed
average).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AdamHyper", "OneBitSchedule", "ZeroOneSchedule", "moment", "variance",
           "denominator", "direction", "fuse", "unfuse", "FUSED", "reference"]


@dataclass(frozen=True)
class AdamHyper:
    """One parameter group's settings (names as ``torch.optim.Adam``'s)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = True


def moment(m, g, beta1: float):
    """``b1 m + (1 - b1) g``: the momentum after gradient ``g``."""
    return m * beta1 + g * (1.0 - beta1)


def variance(v, g, beta2: float):
    """``b2 v + (1 - b2) g*g``: the variance after gradient ``g``."""
    return v * beta2 + (g * g) * (1.0 - beta2)


def denominator(B, v, h: AdamHyper, k: int):
    """``sqrt(v') + eps``, ``v' = v / (1 - b2^k)`` (``k``: variance updates so far; no
    correction without ``bias_correction``, or before the first update)."""
    # sqrt in float64, then rounded once: the correctly rounded float32 square root on
    # every backend (torch's float32 sqrt on CPU is not, numpy's and CUDA's are)
    root = B.cast(B.sqrt(B.cast(v, "float64")), "float32")
    if h.bias_correction and k > 0:
        root = root * (1.0 / (1.0 - h.beta2 ** k) ** 0.5)
    return root + h.eps


def momentum_factor(h: AdamHyper, t: int) -> float:
    """``1 / (1 - b1^t)``: the momentum's bias correction at step ``t`` (1 without)."""
    return 1.0 / (1.0 - h.beta1 ** t) if h.bias_correction else 1.0


def direction(p, m, denom, h: AdamHyper, t: int):
    """``d = m' / denom + wd p``: the step is ``p - lr d`` (decoupled weight decay, as
    AdamW and DeepSpeed's 1-bit Adam)."""
    d = (m * momentum_factor(h, t)) / denom
    if h.weight_decay:
        d = d + p * h.weight_decay
    return d


class OneBitSchedule:
    """1-bit Adam's phases: steps ``1 .. freeze_step`` are dense (Adam), later ones send
    the momentum compressed with the variance frozen.  Steps count from 1."""

    def __init__(self, freeze_step: int):
        if int(freeze_step) < 0:
            raise ValueError(f"freeze_step must be >= 0, got {freeze_step}")
        self.freeze_step = int(freeze_step)

    def dense(self, t: int) -> bool:
        return t <= self.freeze_step

    def variance_updates(self, t: int) -> int:
        """Variance updates made up to and including step ``t``."""
        return min(t, self.freeze_step)

    def advance(self, t: int) -> None:
        pass

    def seek(self, t: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class ZeroOneSchedule:
    """0/1 Adam's policy (see the module docstring): which steps update the variance,
    when the variance freezes, and the local steps' spacing afterwards.  The same on
    every rank.  :meth:`kind` says what step ``t`` does, :meth:`advance` moves on
    after it (its learning rate ``lr`` added to the sync's sum)."""

    VARIANCE, COMPRESSED, LOCAL = "variance", "compressed", "local"

    def __init__(self, var_freeze_step: int, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16):
        for key, value, least in (("var_freeze_step", var_freeze_step, 0),
                                  ("var_update_scaler", var_update_scaler, 1),
                                  ("local_step_scaler", local_step_scaler, 1),
                                  ("local_step_clipper", local_step_clipper, 1)):
            if int(value) < least:
                raise ValueError(f"{key} must be >= {least}, got {value}")
        self.var_freeze_step, self.var_update_scaler = int(var_freeze_step), int(var_update_scaler)
        self.local_step_scaler, self.local_step_clipper = int(local_step_scaler), \
            int(local_step_clipper)
        self._start()

    def _start(self) -> None:
        self.var_interval, self.var_counter, self.var_updates = 1, 0, 0
        self.local_interval, self.local_counter = 1, 0
        self.position = 0  # the last step advanced past

    def seek(self, t: int) -> None:
        """The schedule after step ``t``, whatever it was at: it depends on the step count
        only, so ranks that agree on the count agree on it (replayed from the start
        when it is not where it should be)."""
        if t != self.position:
            self._start()
            for k in range(1, int(t) + 1):
                self.advance(k)

    def kind(self, t: int) -> str:
        if t > self.var_freeze_step:
            return self.LOCAL
        return self.VARIANCE if t % self.var_interval == 0 else self.COMPRESSED

    def syncs(self, t: int) -> bool:
        """Whether local step ``t`` ends with the ranks' sync."""
        return t % self.local_interval == 0

    def entering_local(self, t: int) -> bool:
        """Whether step ``t`` is the first local step (error feedback restarts)."""
        return t == self.var_freeze_step + 1

    def advance(self, t: int) -> None:
        """The schedule after step ``t``."""
        self.position = t
        kind = self.kind(t)
        if kind == self.VARIANCE:
            self.var_updates += 1
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2
        elif kind == self.LOCAL:
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, self.local_interval * 2)

    _FIELDS = ("var_interval", "var_counter", "var_updates", "local_interval", "local_counter",
               "position")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._FIELDS}

    def load_state_dict(self, sd: dict) -> None:
        for k in self._FIELDS:
            setattr(self, k, int(sd[k]))
        self.position = int(sd.get("position", -1))  # (unknown: replayed at the next seek)


#: the name the fused buffer travels by (its compressor state, its collectives)
FUSED = "hvd_compress.adam.fused"


def fuse(B, xs):
    """The tensors ``xs`` as one float32 vector, in order: what travels.  As DeepSpeed's
    compressed allreduce, the whole model goes as one buffer -- one encode, one alltoall
    and one allgather a step, not a pair of collectives per tensor."""
    return B.concat([B.reshape(B.cast(x, "float32"), (-1,)) for x in xs])


def unfuse(B, flat, like) -> list:
    """:func:`fuse`'s vector cut back into tensors shaped (and typed) as ``like``."""
    out, at = [], 0
    for x in like:
        shape = tuple(B.shape(x))
        n = 1
        for d in shape:
            n *= int(d)
        piece = B.reshape(flat[at:at + n], shape)
        out.append(piece if B.dtype_name(x) == "float32" else B.cast(piece, B.dtype_name(x)))
        at += n
    return out


def _mean(B, xs):
    """The ranks' average as the dense engine computes it: the sum in rank order, times
    ``1 / p`` (exact whatever the order for the tests' dyadic gradients)."""
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total * (1.0 / len(xs))


def reference(B, algorithm: str, schedule, hyper: AdamHyper, params, grads, workers):
    """Train every rank at once by the paper's update: the numpy reference of the torch
    optimizers.  ``algorithm``: ``"onebit"`` or ``"zeroone"``; ``schedule``: its
    schedule (advanced here); ``params``: the starting tensors (the same on every rank);
    ``grads(t, r, params_r)``: rank r's gradients at step t (1, 2, ...) given its
    parameters, as a list, for as many steps as it returns lists (None: stop);
    ``workers``: one compressor per rank (their state advances; the compressed average is
    :func:`.twophase.reference` of the tensors made one by :func:`fuse`).  Returns the
    ranks' parameters after every step: ``[step][rank][tensor]``."""
    from .twophase import reference as two_phase

    p = len(workers)
    ps = [[B.copy(x) for x in params] for _ in range(p)]
    ms = [[B.zeros(B.shape(x)) for x in params] for _ in range(p)]
    vs = [B.zeros(B.shape(x)) for x in params]  # the same on every rank
    us = [[B.zeros(B.shape(x)) for x in params] for _ in range(p)]
    lrs, out, t = 0.0, [], 0
    zeroone = algorithm == "zeroone"

    def compressed(xs):  # xs[r][i] -> the average every rank receives, fused
        (avg,) = two_phase(workers, [[fuse(B, x)] for x in xs], [FUSED])
        return unfuse(B, avg, xs[0])

    while True:
        t += 1
        gs = [grads(t, r, ps[r]) for r in range(p)]
        if gs[0] is None:
            return out
        kind = schedule.kind(t) if zeroone else ("variance" if schedule.dense(t) else "momentum")
        if zeroone and schedule.entering_local(t):
            for w in workers:
                w.load_state_dict({"spec": w.params, "tensors": {}})
        if kind == "variance":
            g = [_mean(B, [gs[r][i] for r in range(p)]) for i in range(len(params))]
            vs = [variance(v, gi, hyper.beta2) for v, gi in zip(vs, g)]
            ms = [[moment(m, gi, hyper.beta1) for m, gi in zip(ms[r], g)] for r in range(p)]
        elif kind == "compressed":
            g = compressed(gs)
            ms = [[moment(m, gi, hyper.beta1) for m, gi in zip(ms[r], g)] for r in range(p)]
        else:  # momentum (1-bit Adam) and local (0/1 Adam): the worker's own gradient
            ms = [[moment(m, gi, hyper.beta1) for m, gi in zip(ms[r], gs[r])] for r in range(p)]
            if kind == "momentum":
                avg = compressed(ms)
                ms = [[B.copy(a) for a in avg] for _ in range(p)]
        k = schedule.var_updates + (kind == "variance") if zeroone else \
            schedule.variance_updates(t)
        dens = [denominator(B, v, hyper, k) for v in vs]
        for r in range(p):
            ds = [direction(x, m, dn, hyper, t) for x, m, dn in zip(ps[r], ms[r], dens)]
            ps[r] = [x - d * hyper.lr for x, d in zip(ps[r], ds)]
            if kind == "local":
                us[r] = [u - d * hyper.lr for u, d in zip(us[r], ds)]
        if kind == "local":
            lrs += hyper.lr
            if schedule.syncs(t):
                sent = [[u * dn for u, dn in zip(us[r], dens)] for r in range(p)]
                ps = [[x - u for x, u in zip(ps[r], us[r])] for r in range(p)]
                avg = compressed(sent)
                back = -1.0 / (lrs * momentum_factor(hyper, t))
                ms = [[a * back for a in avg] for _ in range(p)]
                ps = [[x + a / dn for x, a, dn in zip(ps[r], avg, dens)] for r in range(p)]
                us = [[B.zeros(B.shape(x)) for x in params] for _ in range(p)]
                lrs = 0.0
        schedule.advance(t)
        out.append([[B.copy(x) for x in ps[r]] for r in range(p)])
