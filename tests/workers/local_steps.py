"""Bodies for tests/test_local_steps.py (torch), run under horovodrun -np 2.

A tiny model -- BatchNorm1d(4, affine=False) then Linear(4, 1), squared loss,
plain SGD -- whose local SGD and DGA trajectories are computed by hand in
numpy (float64) for every rank, and compared with what the optimizer did.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.workers.local_hand import BN_MOMENTUM, EPS, LR, HandDGA, HandLocalSGD, data


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


def _lin(model):
    return model.lin.weight.detach().double().numpy()[0], float(model.lin.bias.detach()[0])


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
                                  named_buffers=model.named_buffers(), min_numel=0)
    hand = HandLocalSGD(*_lin(model), size, period, warmup)
    mine = hand.hands[rank]
    log = []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
        hand.step(step)
        both = hvd.allgather_object(_flat(model).tolist())
        stats = hvd.allgather_object(
            [model.bn.running_mean.double().tolist(), model.bn.running_var.double().tolist()])
        log.append({"params": both, "buffers": stats, "hand": mine.flat.tolist(),
                    "hand_buffers": [mine.rm.tolist(), mine.rv.tolist()],
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
                                  delay=delay, min_numel=0)
    sync = hvd.DistributedOptimizer(torch.optim.SGD(sync_model.parameters(), lr=LR),
                                    named_parameters=sync_model.named_parameters(), )
    hand = HandDGA(*_lin(model), size, delay)
    # the same by hand with the compressor's exchange (numpy), named as the optimizer names
    exact = HandDGA(*_lin(model), size, delay, spec=spec,
                    layout=[(n, tuple(p.shape)) for n, p in model.named_parameters()])
    log = []
    for step in range(steps):
        for m, o in ((model, opt), (sync_model, sync)):
            o.zero_grad()
            loss_of(m, rank, step).backward()
            o.step()
        hand.step(step)
        exact.step(step)
        log.append({"params": _flat(model).tolist(), "hand": hand.hands[rank].flat.tolist(),
                    "hand_compressed": exact.hands[rank].flat.tolist(),
                    "sync": _flat(sync_model).tolist(),
                    "collectives": opt.last_stats["collectives"],
                    "comm_ms": opt.last_stats["comm_ms"]})
    opt.drain()
    return log
