"""Bodies for tests/test_torch_hierarchy.py: our optimizer under 2 simulated nodes of 2
workers (hvd_compress.tools.nodesrun), the node process sets registered at init."""

from __future__ import annotations

import numpy as np
import torch

from hvd_compress.core import build
from tests.workers.reference import Reference, hierarchical_step
from tests.workers.torch_opt import exchange_step, make_model, record_noise

SPECS = ["topk:ratio=0.1", "dgc:ratio=0.05", "onebit", "none", "randomk:ratio=0.1", "terngrad:sum=int"]


def aggregate_matches_definition(specs=SPECS, steps=2, dynamic=False):
    """Per spec, hierarchical (auto) and flat (``hierarchical=False``): each step's
    averaged gradients against the numpy reference of each exchange, the account's
    bytes between nodes, and the refusals."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    from hvd_compress import nodes
    from hvd_compress.core.hierarchy import shard_length
    if dynamic:
        hvd.init()
        sets = nodes.add_node_process_sets(hvd)
    else:
        sets = nodes.node_process_sets()
        hvd.init(process_sets=sets)
    rank, size = hvd.rank(), hvd.size()
    n_nodes, per = hvd.cross_size(), hvd.local_size()
    report = {"sets": [s.ranks for s in sets]}
    for spec in specs:
        for hierarchical in (None, False):
            model = make_model()
            opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(),
                                          compression=spec, min_numel=0,
                                          hierarchical=hierarchical)
            comps = [build(spec, rank=r, world_size=size) for r in range(size)]
            ref = Reference(spec, size)
            worst, sent = 0.0, []
            log = record_noise(opt)  # (the quantizers' noise: torch draws its own)
            for step in range(steps):
                local, got, noise = exchange_step(opt, model, rank, step, log=log)
                got = {n: g.numpy() for n, g in got.items()}
                everyone = hvd.allgather_object({k: v.numpy() for k, v in local.items()})
                noises = hvd.allgather_object(noise)
                if opt.hierarchical:
                    expect = hierarchical_step(comps, everyone, n_nodes, per, noises=noises)
                else:
                    expect = ref.step(everyone, noises)
                for name, value in expect.items():
                    diff = float(np.max(np.abs(got[name].astype(np.float64) - value)))
                    err = diff / max(1e-6, float(np.max(np.abs(value))))
                    if err > worst:
                        worst, where = err, f"{name} step {step}"
                sent.append(opt.last_stats["bytes_sent"])
            key = f"{spec}|{'flat' if hierarchical is False else 'auto'}"
            report[key] = {"hierarchical": opt.hierarchical, "rel_err": worst,
                           "worst_at": where if worst else None, "bytes_sent": sent,
                           "local_bytes": opt.last_stats["local_bytes"]}
            if opt.hierarchical:  # what crosses between nodes: each shard's payload
                comp = build(spec)
                want = 0
                for name, p in model.named_parameters():
                    k = shard_length(p.numel(), per)
                    shape = (k, 1) if p.dim() >= 2 else (k,)
                    want += comp.payload_nbytes(comp.meta_for(np.zeros(shape, np.float32), name))
                report[key]["formula_bytes"] = want
    try:
        hc.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1),
                                compression="topk:ratio=0.1", hierarchical=True,
                                process_set=hvd.global_process_set if not sets else sets[0])
        report["refusal"] = None
    except ValueError as exc:
        report["refusal"] = str(exc)
    return {"rank": rank, "report": report}
