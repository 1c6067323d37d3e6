"""Bodies for tests/test_adam.py: 1-bit Adam and 0/1 Adam wrapped by our optimizer under
horovodrun, against the numpy reference of the papers' update
(:func:`hvd_compress.core.adam.reference`), bit for bit, and a resume mid-run.

Gradients are ``D[t, r] + p / 4`` rounded, on multiples of 2^-10 (``D`` in [-0.5, 0.5)): the
dense averages of the warm-up and the variance steps are exact whatever order Gloo sums in."""

from __future__ import annotations

import io

import numpy as np
import torch

from hvd_compress.core import adam as rule
from hvd_compress.core import build
from hvd_compress.core.backend import NumpyBackend

SHAPES = [(8, 6), (6,), (5, 4)]
HYPER = dict(lr=0.01, weight_decay=0.05)


def _start():
    rng = np.random.default_rng(7)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _dyadic(t: int, r: int) -> list:
    rng = np.random.default_rng(1000 * t + r)
    return [(rng.integers(-512, 512, s) / 1024.0).astype(np.float32) for s in SHAPES]


def _grads(t, r, ps):
    """Rank r's gradients at step t: on multiples of 2^-10, so that sums are exact."""
    return [d + np.round(x * 256.0) / 1024.0 for d, x in zip(_dyadic(t, r), ps)]


def _schedule(algorithm, sched):
    if algorithm == "onebit":
        return rule.OneBitSchedule(**sched)
    return rule.ZeroOneSchedule(**sched)


def _optimizer(hc, algorithm, params, sched, bias_correction):
    cls = hc.OneBitAdam if algorithm == "onebit" else hc.ZeroOneAdam
    return cls(params, bias_correction=bias_correction, **HYPER, **sched)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.from_numpy(x.copy()))
                                          for x in _start()])


def _run(hc, hvd, algorithm, spec, sched, bias_correction, steps, model=None, opt=None,
         first=1):
    if model is None:
        model = _Model()
        opt = hc.DistributedOptimizer(
            _optimizer(hc, algorithm, model.parameters(), sched, bias_correction),
            named_parameters=model.named_parameters(), compression=spec, min_numel=0,
            exchange="two-phase")
        # as the examples start: Horovod steps a fresh optimizer to make its state, which
        # must not count as a step of the rule (it moved the freeze one step early)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    out, wire = [], []
    for t in range(first, first + steps):
        opt.zero_grad()
        with torch.no_grad():
            gs = _grads(t, hvd.rank(), [p.detach().numpy() for p in model.ws])
        for p, g in zip(model.ws, gs):
            p.grad = torch.from_numpy(g)
        opt.step()
        out.append([p.detach().numpy().copy() for p in model.ws])
        wire.append((opt.last_stats["wire_out"], opt.last_stats["wire_in"],
                     opt.last_stats["collectives"]))
    return model, opt, out, wire


def matches_reference(algorithm, spec, sched, steps, bias_correction=True, resume_at=None):
    """This rank's parameters after every step, the reference's for every rank, the
    account per step, and (``resume_at``) the steps after a save at ``resume_at`` loaded
    into a fresh model and optimizer."""
    import hvd_compress.torch as hc
    from tests.workers.diloco import init_with_pair
    hvd, _ = init_with_pair()  # (the np 3 launch is shared with DiLoCo's bodies)
    rank, size = hvd.rank(), hvd.size()
    model, opt, got, wire = _run(hc, hvd, algorithm, spec, sched, bias_correction, steps)
    h = rule.AdamHyper(bias_correction=bias_correction, **HYPER)
    workers = [build(spec, rank=r, world_size=size) for r in range(size)]
    ref = rule.reference(NumpyBackend(), algorithm, _schedule(algorithm, sched), h, _start(),
                         lambda t, r, ps: _grads(t, r, ps) if t <= steps else None,
                         workers=workers)
    report = {"got": [[x.tolist() for x in step] for step in got],
              "same": [all(np.array_equal(a, b) for a, b in zip(mine, ref[i][rank]))
                       for i, mine in enumerate(got)],
              "max_diff": max(float(np.max(np.abs(a.astype(np.float64) - b)))
                              for i, mine in enumerate(got) for a, b in zip(mine, ref[i][rank])),
              "ranks_agree": [all(np.array_equal(a, b) for r in range(size)
                                  for a, b in zip(ref[i][0], ref[i][r])) for i in range(steps)],
              "wire": wire}
    if resume_at is not None:
        m2, o2, before, _ = _run(hc, hvd, algorithm, spec, sched, bias_correction, resume_at)
        buf = io.BytesIO()
        torch.save({"model": m2.state_dict(), "opt": o2.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf)
        m3 = _Model()
        o3 = hc.DistributedOptimizer(
            _optimizer(hc, algorithm, m3.parameters(), sched, bias_correction),
            named_parameters=m3.named_parameters(), compression=spec, min_numel=0,
            exchange="two-phase")
        m3.load_state_dict(saved["model"])
        o3.load_state_dict(saved["opt"])
        _, _, after, _ = _run(hc, hvd, algorithm, spec, sched, bias_correction,
                              steps - resume_at, model=m3, opt=o3, first=resume_at + 1)
        report["resumed_same"] = all(
            np.array_equal(a, b) for mine, ref_step in zip(before + after, got)
            for a, b in zip(mine, ref_step))
    return report
