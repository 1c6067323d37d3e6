"""The numpy reference aggregation the multi-process tests compare against (no framework)."""

from __future__ import annotations

import numpy as np

from hvd_compress.core.exchange import MAX


class Reference:
    """Every rank's compressor replayed in numpy; aggregates as the optimizer should."""

    def __init__(self, spec, size):
        from hvd_compress.core import build
        self.comps = [build(spec, rank=r, world_size=size) for r in range(size)]
        self.size = size

    def step(self, grads_by_rank, noise_by_rank):
        """grads_by_rank[r][name] -> numpy; returns {name: averaged aggregate}."""
        out = {}
        comp0 = self.comps[0]
        for name in grads_by_rank[0]:
            encs = []
            for r, comp in enumerate(self.comps):
                noise = noise_by_rank[r].get(name)
                encs.append(comp.encode(grads_by_rank[r][name], name, noise=noise))
            for r in range(comp0.rounds(encs[0].meta) - 1):
                if comp0.round_op(r) == MAX:  # the scales integer sums share
                    total = np.maximum.reduce([e.payload for e in encs])
                else:
                    total = sum(e.payload for e in encs)
                encs = [c.next_round(e, total) for c, e in zip(self.comps, encs)]
            if comp0.summable:
                received = encs[0].payload
                for e in encs[1:]:
                    received = comp0.reduce_pair(received, e.payload)
            else:
                received = [e.payload for e in encs]
            # every rank aggregates (PowerSGD updates its warm-start Q there)
            aggs = [c.aggregate(received, e) for c, e in zip(self.comps, encs)]
            out[name] = aggs[0] / self.size
        return out
