"""The tiny model of the local SGD / DGA tests, by hand in numpy (float64), per rank.

BatchNorm (no affine, batch statistics, running mean and unbiased running
variance with momentum 0.1, as torch's BatchNorm1d) then a linear layer
``x @ w + b``, squared loss, plain SGD with learning rate ``LR``.
"""

from __future__ import annotations

import numpy as np

LR = 0.05
EPS, BN_MOMENTUM = 1e-5, 0.1


def data(rank, step):
    g = np.random.default_rng(100 * rank + step)
    x = g.normal(size=(8, 4)) * (1 + rank) + rank
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.3
    return x.astype(np.float32), y.astype(np.float32)


class Hand:
    """One rank's model in numpy: weights, bias, BatchNorm running statistics."""

    def __init__(self, w, b, bn=True):
        self.w = np.asarray(w, np.float64).reshape(-1).copy()
        self.b = float(b)
        self.bn = bn
        self.rm, self.rv = np.zeros(4), np.ones(4)

    def grad(self, rank, step):
        x, y = (a.astype(np.float64) for a in data(rank, step))
        if self.bn:
            mean, var = x.mean(0), x.var(0)
            self.rm = (1 - BN_MOMENTUM) * self.rm + BN_MOMENTUM * mean
            self.rv = (1 - BN_MOMENTUM) * self.rv + BN_MOMENTUM * x.var(0, ddof=1)
            x = (x - mean) / np.sqrt(var + EPS)
        r = x @ self.w + self.b - y
        return np.concatenate([2 * x.T @ r / len(y), [2 * r.mean()]])

    def step(self, g):
        self.w = self.w - LR * g[:4]
        self.b = self.b - LR * g[4]

    @property
    def flat(self):
        return np.concatenate([self.w, [self.b]])


class HandLocalSGD:
    """Every rank's local SGD trajectory: ``warmup`` synchronous steps, then local steps
    with an average of parameters and BatchNorm statistics after every ``period``-th."""

    def __init__(self, w, b, size, period, warmup=0, bn=True):
        self.hands = [Hand(w, b, bn) for _ in range(size)]
        self.period, self.warmup = period, warmup

    def step(self, step):
        gs = [h.grad(r, step) for r, h in enumerate(self.hands)]
        if step < self.warmup:  # synchronous: everyone steps on the average gradient
            for h in self.hands:
                h.step(np.mean(gs, 0))
            return
        for h, g in zip(self.hands, gs):
            h.step(g)
        if (step - self.warmup + 1) % self.period == 0:
            for key in ("w", "b", "rm", "rv"):
                avg = np.mean([getattr(h, key) for h in self.hands], 0)
                for h in self.hands:
                    setattr(h, key, avg)


class HandDGA:
    """Every rank's DGA trajectory: ``w -= LR * (g_i - g_{i-D} + mean_r g_{i-D})``.

    ``spec`` and ``layout`` (the weight's and the bias's ``(name, shape)``, as the wrapper
    names them): the mean is that of the compressor's exchange instead -- every rank's
    numpy compressor encodes its float32 ``g_i`` when step ``i`` starts its exchange
    (the state, residuals included, going on in step order), the decoded payloads
    averaged."""

    def __init__(self, w, b, size, delay, spec=None, layout=None):
        self.hands = [Hand(w, b, bn=False) for _ in range(size)]
        self.delay = delay
        self.history = []  # per step: every rank's local gradient
        self.means = []    # per step: the exchange's average of the local gradients
        self.layout = layout
        self.ref = None
        if spec is not None:
            from tests.workers.reference import Reference
            self.ref = Reference(spec, size)

    def _mean(self, gs):
        if self.ref is None:
            return np.mean(gs, 0)
        (wn, ws), (bn, bs) = self.layout
        grads = [{wn: g[:4].astype(np.float32).reshape(ws), bn: g[4:].astype(np.float32).reshape(bs)}
                 for g in gs]
        out = self.ref.step(grads, [{} for _ in gs])
        return np.concatenate([out[wn].reshape(-1), out[bn].reshape(-1)]).astype(np.float64)

    def step(self, step):
        gs = [h.grad(r, step) for r, h in enumerate(self.hands)]
        self.history.append(gs)
        self.means.append(self._mean(gs))
        for r, h in enumerate(self.hands):
            if step < self.delay:
                h.step(gs[r])
            else:
                old = self.history[step - self.delay]
                h.step(gs[r] - old[r] + self.means[step - self.delay])


def check_local_log(results, period, warmup, steps, exact):
    """Assert what local SGD promises on the per-step logs of every rank: ranks agree
    right after each average (and in warm-up) and differ between; messages only on
    averaging steps (where counted); parameters within ``exact`` of the hand
    computation; buffers averaged."""
    for rank, log in enumerate(results):
        assert len(log) == steps
        for step, entry in enumerate(log):
            p0, p1 = (np.array(p) for p in entry["params"])
            syncs = step < warmup or (step - warmup + 1) % period == 0
            if syncs:  # identical right after every average (and in warm-up)
                assert np.array_equal(p0, p1), step
            else:  # each worker went its own way
                assert np.abs(p0 - p1).max() > 1e-3, step
            if step >= warmup and entry["collectives"] is not None:  # only every `period`
                assert (entry["collectives"] > 0) == syncs, step
            if step >= warmup and entry["bytes"] is not None:
                assert (entry["bytes"] > 0) == syncs, step
            mine = np.array(entry["params"][rank])
            assert np.abs(mine - entry["hand"]).max() < exact, step
            if syncs and step >= warmup:  # BatchNorm statistics averaged too
                b0, b1 = (np.array(b) for b in entry["buffers"])
                assert np.array_equal(b0, b1)
                assert np.abs(b0 - entry["hand_buffers"]).max() < 1e-5
