"""Bodies for tests/test_torch_twophase.py: our optimizer with ``exchange="two-phase"`` and
``"auto"`` under horovodrun, against the numpy definition (:mod:`hvd_compress.core.twophase`)."""

from __future__ import annotations

import numpy as np
import torch

from hvd_compress.core import build
from hvd_compress.core.twophase import reference, takes_two_phase
from tests.workers.reference import Reference
from tests.workers.torch_opt import exchange_step, make_model

#: deterministic encoders (torch draws its own noise: the stochastic ones are checked
#: against the reference in numpy, tests/test_twophase.py)
SPECS = ["topk:ratio=0.1", "dgc:ratio=0.05", "onebit", "threshold:tau=0.01", "efsignsgd",
         "thresholdv:tau=0.01", "none"]


def _expected(spec, size, refs, flat_ref, everyone, exchange_of):
    """Each tensor's average by the exchange it went (the plan says), from the numpy
    compressors ``refs`` (two-phase) and ``flat_ref`` (the flat engine's)."""
    names = list(everyone[0])
    two = [n for n in names if exchange_of(n) == "two-phase"]
    flat = [n for n in names if n not in two]
    out = {}
    if two:
        got = reference(refs, [[g[n] for n in two] for g in everyone], two)
        out.update(dict(zip(two, got)))
    if flat:
        out.update(flat_ref.step([{n: g[n] for n in flat} for g in everyone],
                                 [{} for _ in everyone]))
    return out


def matches_reference(specs=SPECS, steps=2, exchanges=("two-phase", "auto")):
    """Per spec and exchange: every step's averaged gradients against the definition of
    the exchange each tensor took, the ranks' choices alike, the account's bytes."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    report = {}
    for spec in specs:
        for exchange in exchanges:
            model = make_model()
            opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(),
                                          compression=spec, min_numel=0, exchange=exchange)
            refs = [build(spec, rank=r, world_size=size) for r in range(size)]
            flat_ref = Reference(spec, size)
            worst, where, wire = 0.0, None, []
            for step in range(steps):
                local, got, _ = exchange_step(opt, model, rank, step)
                got = {n: g.numpy() for n, g in got.items()}
                everyone = hvd.allgather_object({k: v.numpy() for k, v in local.items()})
                plan = {r.name: r.exchange for r in opt.plan()}
                expect = _expected(spec, size, refs, flat_ref, everyone,
                                   lambda n: plan[n])
                for name, value in expect.items():
                    diff = float(np.max(np.abs(got[name].astype(np.float64) - value)))
                    if diff > worst:
                        worst, where = diff, f"{name} step {step}"
                wire.append((opt.last_stats["wire_out"], opt.last_stats["wire_in"]))
            comp = build(spec)
            two = {n for n, p in model.named_parameters()
                   if takes_two_phase(comp, tuple(p.shape), size)}
            report[f"{spec}|{exchange}"] = {
                "max_diff": worst, "worst_at": where, "wire": wire,
                "plan": {r.name: (r.exchange, r.why) for r in opt.plan()},
                "can_two_phase": sorted(two),
                "whole": sum(comp.payload_nbytes(comp.meta_for(p.detach().numpy(), n))
                             for n, p in model.named_parameters()),
                "hierarchical": opt.hierarchical}
    try:
        hc.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1),
                                compression="topk:ratio=0.1", exchange="allreduce")
        report["refusal"] = None
    except ValueError as exc:
        report["refusal"] = str(exc)
    return {"rank": rank, "report": report}
