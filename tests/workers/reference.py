"""The numpy reference aggregation the multi-process tests compare against (no framework)."""

from __future__ import annotations

import numpy as np

from hvd_compress.core import build
from hvd_compress.core.exchange import MAX


class Reference:
    """Every rank's compressor replayed in numpy; aggregates as the optimizer should."""

    def __init__(self, spec, size, backend=None):
        """``backend``: the numpy backend to replay on; ``NumpyBackend("out_last")`` for
        TensorFlow's runs (their matrix view, :mod:`hvd_compress.core.layout`)."""
        kw = {} if backend is None else {"backend": backend}
        self.comps = [build(spec, rank=r, world_size=size, **kw) for r in range(size)]
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


def hierarchical_step(comps, grads_by_rank, nodes, per, average=True, noises=None):
    """The hierarchical exchange's aggregate by its definition, one step: ``comps`` one
    numpy compressor per worker (rank ``c * per + l``, their state kept across steps),
    ``grads_by_rank[r][name]``.  Summable compressors: the flat sum over every worker;
    the others and the integer sums: per node the dense sum, its shard ``l`` compressed
    by worker ``(c, l)`` (named ``name@l/per``, a ``(k, 1)`` matrix for tensors of 2+
    dimensions), the shards' payloads summed over nodes (integer sums: the scales' max,
    then the codes' int32 sum), the shards put together.  ``noises[r][shard name]``: the
    noise worker ``r`` drew for a shard (else each compressor draws its own).  Returns
    {name: aggregate}."""
    from hvd_compress.core.hierarchy import shard_length, shard_name
    p = nodes * per
    out = {}
    for name in grads_by_rank[0]:
        xs = [np.asarray(grads_by_rank[r][name], np.float32) for r in range(p)]
        shape = xs[0].shape
        if comps[0].summable and not comps[0].integer_sum:
            encs = [c.encode(x, name) for c, x in zip(comps, xs)]
            total = comps[0].aggregate(sum(e.payload for e in encs), encs[0])
            out[name] = total / p if average else total
            continue
        n = xs[0].size
        k = shard_length(n, per)
        shards = []
        for lr in range(per):
            encs = []
            for c in range(nodes):
                node_sum = sum(xs[c * per + j].reshape(-1) for j in range(per))
                part = np.pad(node_sum, (0, k * per - n))[lr * k:(lr + 1) * k]
                part = part.reshape(k, 1) if len(shape) >= 2 else part
                sname = shard_name(name, lr, per)
                noise = None if noises is None else noises[c * per + lr].get(sname)
                encs.append(comps[c * per + lr].encode(part, sname) if noise is None else
                            comps[c * per + lr].encode(part, sname, noise=noise))
            mine = [comps[c * per + lr] for c in range(nodes)]
            if comps[0].integer_sum:  # scales by max, then the codes' int32 sum (wrapping)
                shared = np.max([e.payload for e in encs], axis=0)
                encs = [m.next_round(e, shared) for m, e in zip(mine, encs)]
                words = np.sum([e.payload.astype(np.int64) for e in encs], axis=0)
                total = ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32)
                got = [m.aggregate(total, e) for m, e in zip(mine, encs)]
            else:
                got = [m.aggregate([e.payload for e in encs], e) for m, e in zip(mine, encs)]
            shards.append(got[0].reshape(-1))
        dense = np.concatenate(shards)[:n].reshape(shape)
        out[name] = dense * np.float32(1.0 / p) if average else dense
    return out


def check_predivided(spec, f, runs, tol=1e-5):
    """Each step's averaged gradients (``runs[r]["steps"][s]["got"]``, every rank alike)
    against their definition with predivide ``f`` (horovod/torch/optimizer.py 0.28.1:
    prescale 1/f, postscale f, Horovod's 1/size): every rank's compressor, replayed in
    numpy, encodes ``local / f``; the decoded payloads' sum times ``f / p``.  Returns
    the averaged gradients, per step and name."""
    size = len(runs)
    comps = [build(spec, rank=r, world_size=size) for r in range(size)]
    out = []
    for step in range(len(runs[0]["steps"])):
        expect = {}
        for name in runs[0]["steps"][step]["local"]:
            total = 0
            for r, comp in enumerate(comps):
                x = np.array(runs[r]["steps"][step]["local"][name], np.float32)
                enc = comp.encode(x * np.float32(1.0 / f), name)
                total = total + comp.decode(enc.payload, enc.meta, enc.ctx)
            expect[name] = total * np.float32(f / size)
            for run in runs:
                np.testing.assert_allclose(run["steps"][step]["got"][name], expect[name],
                                           rtol=tol, atol=tol * 0.1,
                                           err_msg=f"{spec} f={f} {name} step {step}")
        out.append(expect)
    return out


def check_join(spec, runs, replay, key="params"):
    """Rank 1 ran one step fewer and joined (``runs[r]["steps"][s]``: the local gradients
    and the averaged ones, by name, flattened): at every step the averaged gradients are
    the numpy reference of both ranks' exchange; at rank 0's extra step rank 1 adds zeros
    (Horovod's join: rank 0's payload alone, divided by 2; rank 1's residual stays with
    it).  Each rank's parameters (``runs[r][key]``) are ``replay(first, grads)`` of the
    base optimizer over the averaged gradients from the common start."""
    ref = Reference(spec, 2)
    done = [len(run["steps"]) for run in runs]
    assert done == [3, 2], done
    expect = []
    for step in range(done[0]):
        grads = [{n: np.array(g, np.float32) for n, g in run["steps"][step]["local"].items()}
                 for run in runs[:2 if step < done[1] else 1]]
        if len(grads) == 2:
            expect.append(ref.step(grads, [{}, {}]))
        else:  # rank 1 joined: Horovod adds zeros where its payload would be (not its residual)
            comp = ref.comps[0]
            assert comp.summable and all(comp.rounds(comp.meta_for(g, n)) == 1
                                         for n, g in grads[0].items())
            encs = {name: comp.encode(g, name) for name, g in grads[0].items()}
            expect.append({name: comp.aggregate(e.payload, e) / 2 for name, e in encs.items()})
        for run in runs[:1] if step >= done[1] else runs:
            for name, value in expect[-1].items():
                np.testing.assert_allclose(run["steps"][step]["got"][name], value,
                                           rtol=1e-5, atol=1e-6, err_msg=f"{name} step {step}")
    assert runs[0]["first"] == runs[1]["first"]
    for run, n in zip(runs, done):
        want = replay(run["first"], [list(expect[s].values()) for s in range(n)])
        assert len(want) == len(run[key])
        for a, b in zip(run[key], want):
            np.testing.assert_allclose(a, np.ravel(b), rtol=0, atol=1e-6)
    assert runs[0][key] != runs[1][key]  # rank 0's extra step moved its parameters
