"""Bodies for tests/test_local_steps.py (torch), run under horovodrun -np 2.

A tiny model -- BatchNorm1d(4, affine=False) then Linear(4, 1), squared loss,
plain SGD -- whose local SGD and DGA trajectories are computed by hand in
numpy (float64) for every rank, and compared with what the optimizer did.
"""

from __future__ import annotations

import numpy as np
import torch

LR = 0.05
EPS, BN_MOMENTUM = 1e-5, 0.1


def data(rank, step):
    g = np.random.default_rng(100 * rank + step)
    x = g.normal(size=(8, 4)) * (1 + rank) + rank
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.3
    return x.astype(np.float32), y.astype(np.float32)


class Tiny(torch.nn.Module):
    def __init__(self, bn=True):
        super().__init__()
        torch.manual_seed(0)
        self.bn = torch.nn.BatchNorm1d(4, affine=False, momentum=BN_MOMENTUM, eps=EPS) \
            if bn else torch.nn.Identity()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(self.bn(x)).squeeze(1)


def loss_of(model, rank, step):
    x, y = data(rank, step)
    return ((model(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean()


class Hand:
    """One rank's model in numpy: weights, bias, BatchNorm running statistics."""

    def __init__(self, model, bn=True):
        self.w = model.lin.weight.detach().double().numpy()[0].copy()
        self.b = float(model.lin.bias.detach()[0])
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


def _flat(model):
    return np.concatenate([model.lin.weight.detach().double().numpy()[0],
                           model.lin.bias.detach().double().numpy()])


def local_sgd(spec="none", period=4, steps=12, warmup=0):
    """Run local SGD; report per step the parameters of both ranks, the hand result
    (for spec none) and the collectives sent."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = Tiny()
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                  named_parameters=model.named_parameters(), compression=spec,
                                  backward_passes_per_step=period, local_sgd=True,
                                  local_sgd_warmup_steps=warmup,
                                  named_buffers=model.named_buffers())
    hands = [Hand(model) for _ in range(size)]
    log = []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
        gs = [h.grad(r, step) for r, h in enumerate(hands)]
        if step < warmup:  # synchronous: everyone steps on the average gradient
            for h in hands:
                h.step(np.mean(gs, 0))
        else:
            for h, g in zip(hands, gs):
                h.step(g)
            if (step - warmup + 1) % period == 0:
                for key in ("w", "b", "rm", "rv"):
                    avg = np.mean([getattr(h, key) for h in hands], 0)
                    for h in hands:
                        setattr(h, key, avg)
        both = hvd.allgather_object(_flat(model).tolist())
        stats = hvd.allgather_object(
            [model.bn.running_mean.double().tolist(), model.bn.running_var.double().tolist()])
        log.append({"params": both, "buffers": stats, "hand": hands[rank].flat.tolist(),
                    "hand_buffers": [hands[rank].rm.tolist(), hands[rank].rv.tolist()],
                    "collectives": opt.last_stats["collectives"],
                    "bytes": opt.last_stats["bytes_sent"]})
    return log


def dga(spec="none", delay=2, steps=8):
    """Run DGA; report per step this rank's parameters, the hand-computed ones and the
    parameters of synchronous training with Horovod's optimizer (for delay=0)."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model, sync_model = Tiny(bn=False), Tiny(bn=False)
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                  named_parameters=model.named_parameters(), compression=spec,
                                  delay=delay)
    sync = hvd.DistributedOptimizer(torch.optim.SGD(sync_model.parameters(), lr=LR),
                                    named_parameters=sync_model.named_parameters(), )
    hands = [Hand(model, bn=False) for _ in range(size)]
    history = []  # per step: every rank's local gradient
    log = []
    for step in range(steps):
        for m, o in ((model, opt), (sync_model, sync)):
            o.zero_grad()
            loss_of(m, rank, step).backward()
            o.step()
        gs = [h.grad(r, step) for r, h in enumerate(hands)]
        history.append(gs)
        for r, h in enumerate(hands):
            if step < delay:
                h.step(gs[r])
            else:
                old = history[step - delay]
                h.step(gs[r] - old[r] + np.mean(old, 0))
        log.append({"params": _flat(model).tolist(), "hand": hands[rank].flat.tolist(),
                    "sync": _flat(sync_model).tolist(),
                    "collectives": opt.last_stats["collectives"],
                    "comm_ms": opt.last_stats["comm_ms"]})
    opt.drain()
    return log
