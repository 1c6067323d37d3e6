"""PowerSGD against PyTorch's own DDP hook, in a real Gloo process group (no Horovod).

Launched by tests/test_powersgd_oracle.py under ``mpirun -np 2`` (the rank comes
from Open MPI's environment; the process group is torch.distributed's Gloo over
TCP).  Each step, both sides get the same gradients and the same Q:

* theirs: ``powerSGD_hook`` on a stand-in for DDP's ``GradBucket`` (it calls only
  ``buffer``, ``index``, ``gradients`` and ``is_last``), with
  ``min_compression_rate=1`` (ours compresses whenever it saves bytes) and the
  vanilla phase skipped;
* ours: the core's PowerSGD on torch tensors, through the exchange engine with
  torch.distributed's allreduce as the collective.

The same starting Q: the hook's Q memory is set to an orthonormal Q0 and ours'
state to the same Q0.  Without warm start the hook draws a fresh Q each step
from its own generator; that Q is read back and given to ours for the step
(ours would draw its own from a hash stream: a different random source by
design, the same algorithm given the same Q).
"""

from __future__ import annotations

import copy
import os

import numpy as np

SHAPES = {"conv.weight": (16, 8, 3, 3), "fc.weight": (40, 64), "fc.bias": (40,),
          "small.weight": (3, 2), "head.weight": (10, 40)}


class _Bucket:
    """Duck-typed ``dist.GradBucket``: one flat buffer and views of it."""

    def __init__(self, flat, shapes):
        self.flat, self.shapes = flat, shapes

    def buffer(self):
        return self.flat

    def index(self):
        return 0

    def is_last(self):
        return True

    def gradients(self):
        out, offset = [], 0
        for shape in self.shapes:
            n = int(np.prod(shape))
            out.append(self.flat[offset:offset + n].view(shape))
            offset += n
        return out


def run(port, rank_=1, ef=True, warm_start=True, steps=6):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from hvd_compress.core import Collectives, Exchange, new_stats
    from hvd_compress.core.powersgd import matrix_shape
    from hvd_compress.core.registry import build
    from hvd_compress.torch.backend import TorchBackend

    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)

    class TorchDist(Collectives):
        size = world

        def allreduce(self, flat, name, op=None, prescale=1.0, postscale=1.0):
            out = flat.clone()
            dist.all_reduce(out)
            return out

    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank_,
                               start_powerSGD_iter=2, min_compression_rate=1,
                               use_error_feedback=ef, warm_start=warm_start,
                               orthogonalization_epsilon=0, random_seed=0)
    state.iter = 2  # past the hook's uncompressed phase (ours has none; see docs/compressors.md)
    comp = build(f"powersgd:rank={rank_},ef={str(ef).lower()},warm_start=true",
                 backend=TorchBackend(), rank=rank, world_size=world)
    engine = Exchange(comp, TorchDist(), average=True)
    names, shapes = list(SHAPES), list(SHAPES.values())
    compressed = [comp.compressed(comp.meta_for(torch.zeros(s), n)) for n, s in SHAPES.items()]
    # the hook's Q memory: compressed matrices in bucket order (shapes are distinct)
    q_sizes = [matrix_shape(comp.meta_for(torch.zeros(s), n))[1] * rank_ if c else 0
               for (n, s), c in zip(SHAPES.items(), compressed)]
    p_sizes = [s[0] * rank_ if c else 0 for s, c in zip(shapes, compressed)]
    gen = torch.Generator().manual_seed(1234)  # the same on every rank
    q0 = [torch.linalg.qr(torch.randn(q // rank_, rank_, generator=gen, dtype=torch.float64))[0]
          .float() if q else None for q in q_sizes]
    if warm_start:
        state.p_memory_dict[0] = torch.empty(sum(p_sizes))
        state.q_memory_dict[0] = torch.cat([q.reshape(-1) for q in q0 if q is not None])
    worst = {"out": 0.0, "q": 0.0, "p_hat": 0.0, "residual_sum": 0.0, "dense": 0.0}
    checks = dict.fromkeys(worst, 0)

    def rel(a, b, key):
        checks[key] += 1
        worst[key] = max(worst[key], float((a.double() - b.double()).norm()
                                           / max(b.double().norm(), 1e-30)))

    for step in range(steps):
        g = [torch.randn(s, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + i))
             for i, s in enumerate(shapes)]
        if not warm_start:  # the Q the hook will draw this step, read from a copy of its RNG
            q_step = _hooks_fresh_q(psgd, copy.deepcopy(state.rng), q_sizes, rank_)
        else:
            q_step = q0 if step == 0 else None
        for i, (name, q) in enumerate(zip(names, q_step or [None] * len(names))):
            if q is not None:
                comp.state(comp.meta_for(g[i], name), like=g[i].reshape(-1))["q"] = q.clone()
        flat = torch.cat([x.reshape(-1) for x in g])
        theirs = psgd.powerSGD_hook(state, _Bucket(flat.clone(), shapes)).wait()
        theirs = _Bucket(theirs, shapes).gradients()
        stats = new_stats()
        batch = engine.send(g, names, stats)
        ours = engine.receive(batch, stats)
        q_mem = state.q_memory_dict.get(0)
        p_mem = state.p_memory_dict.get(0)
        q_off = p_off = 0
        err_off = 0
        for i, (name, c) in enumerate(zip(names, compressed)):
            rel(ours[i], theirs[i], "out")
            n = int(np.prod(shapes[i]))
            if c:
                st = comp.states[name]
                if warm_start:  # the mean Q both keep for the next step
                    q_theirs = q_mem[q_off:q_off + q_sizes[i]].view(-1, rank_)
                    rel(st["q"], q_theirs, "q")
                if p_mem is not None and p_mem.numel():
                    p_hat = batch.encoded[i].ctx.p_hat
                    rel(p_hat, p_mem[p_off:p_off + p_sizes[i]].view(-1, rank_), "p_hat")
                if ef:  # per-rank residuals differ by design; their sums over ranks agree
                    mine = st["residual"].clone()
                    hook = state.error_dict[0][err_off:err_off + n].clone()
                    dist.all_reduce(mine)
                    dist.all_reduce(hook)
                    rel(mine, hook, "residual_sum")
                q_off += q_sizes[i]
                p_off += p_sizes[i]
            else:
                rel(ours[i], theirs[i], "dense")
            err_off += n
    dist.destroy_process_group()
    return {"worst": worst, "checks": checks, "compressed": compressed}


def _hooks_fresh_q(psgd, rng, q_sizes, r):
    """The Qs ``powerSGD_hook`` draws when it (re)initialises a bucket: one torch seed from
    its numpy RandomState, then ``randn`` per compressed matrix in order, orthogonalised."""
    import torch
    out = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.randint(1_000_000_000))
        for q in q_sizes:
            if not q:
                out.append(None)
                continue
            m = torch.randn(1, q // r, r, device="cpu", dtype=torch.float32)
            psgd._orthogonalize(m, 0)
            out.append(m[0])
    return out
