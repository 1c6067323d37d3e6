"""The hierarchical exchange on simulated nodes (threads, no Horovod): the aggregate equals
its definition -- the dense sum inside each node, the compressor on each shard of the node
sums, summed over nodes -- computed independently with the numpy core, and the account's
bytes between nodes equal the formula."""

import threading

import numpy as np
import pytest

from hvd_compress.core import build, new_stats
from hvd_compress.core.hierarchy import Hierarchical, shard_length, shard_name
from tests.test_exchange_engine import Table
from tests.workers.reference import hierarchical_step

SHAPES = {"a.weight": (6, 5), "a.bias": (5,), "b.weight": (4, 3, 2), "odd": (37,)}


def _grads(rank, step):
    rng = np.random.default_rng([rank, step, 3])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]


class Cluster:
    """``nodes`` x ``per`` simulated workers: rank ``r = c * per + l``; a table for all, one
    per node (its set rank is ``l``) and one per local index (its set rank is ``c``)."""

    def __init__(self, nodes, per):
        self.nodes, self.per, self.size = nodes, per, nodes * per
        self.world = Table(self.size)
        self.node = [Table(per) for _ in range(nodes)]
        self.cross = [Table(nodes) for _ in range(per)]

    def engine(self, comp, r, **kw):
        c, li = divmod(r, self.per)
        return Hierarchical(comp, self.world.rank(r), self.node[c].rank(li), self.cross[li].rank(c),
                            li, **kw)


def _run(spec, nodes, per, steps=3, **kw):
    cl = Cluster(nodes, per)
    comps = [build(spec, rank=r, world_size=cl.size) for r in range(cl.size)]
    engines = [cl.engine(comps[r], r, **kw) for r in range(cl.size)]
    out = []
    for step in range(steps):
        stats = [new_stats() for _ in range(cl.size)]
        results = [None] * cl.size

        def rank(r):
            b = engines[r].send(_grads(r, step), list(SHAPES), stats[r], tag=f".{step}")
            results[r] = engines[r].receive(b, stats[r])

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(cl.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(res is not None for res in results), "a rank did not finish"
        out.append((results, stats))
    return out, comps


def _definition(spec, nodes, per, steps=3, average=True):
    """The aggregate by its definition (tests.workers.reference), fresh numpy compressors."""
    p = nodes * per
    comps = [build(spec, rank=r, world_size=p) for r in range(p)]
    return [list(hierarchical_step(comps, [dict(zip(SHAPES, _grads(r, step))) for r in range(p)],
                                   nodes, per, average).values()) for step in range(steps)]


@pytest.mark.parametrize("spec", ["topk:ratio=0.2", "dgc:ratio=0.1", "qsgd:levels=3,bucket=8",
                                  "onebit", "terngrad", "none", "fp16", "randomk:ratio=0.3",
                                  "terngrad:sum=int", "qsgd:sum=int,bucket=8,ef=true",
                                  "signsgd:sum=int"])
@pytest.mark.parametrize("nodes,per", [(2, 2), (3, 2), (2, 3)])
def test_the_aggregate_is_its_definition(spec, nodes, per):
    runs, _ = _run(spec, nodes, per)
    want = _definition(spec, nodes, per)
    for step, ((results, stats), ref) in enumerate(zip(runs, want)):
        for r in range(1, nodes * per):  # every worker holds the same aggregate
            for a, b in zip(results[0], results[r]):
                np.testing.assert_array_equal(a, b)
        for i, name in enumerate(SHAPES):
            assert results[0][i].shape == SHAPES[name]
            tol = 2 ** -8 if spec == "fp16" else 1e-6
            np.testing.assert_allclose(results[0][i], ref[i], rtol=tol, atol=tol,
                                       err_msg=f"{spec} {name} step {step}")


@pytest.mark.parametrize("spec", ["topk:ratio=0.2", "qsgd:levels=3,bucket=8", "onebit",
                                  "terngrad:sum=int"])
def test_bytes_between_nodes_fall_by_the_workers_per_node(spec):
    """The account's bytes (what crosses to other nodes) are each shard's payload: a
    worker's share of what the flat exchange sends, and the formula's."""
    nodes, per = 2, 2
    runs, _ = _run(spec, nodes, per, steps=1)
    comp = build(spec, world_size=nodes * per)
    flat = inter = 0
    for name, shape in SHAPES.items():
        n = int(np.prod(shape))
        k = shard_length(n, per)
        flat += comp.payload_nbytes(comp.meta_for(np.zeros(shape, np.float32), name))
        sshape = (k, 1) if len(shape) >= 2 else (k,)
        inter += comp.payload_nbytes(comp.meta_for(np.zeros(sshape, np.float32), name))
    (results, stats) = runs[0]
    assert [s["bytes_sent"] for s in stats] == [inter] * (nodes * per)
    assert inter < flat * 0.75  # (a shard's payload is about half a tensor's here)
    dense = sum(4 * shard_length(int(np.prod(s)), per) * per for s in SHAPES.values())
    # inside the node: the reduce-scatter's (L-1)/L of the padded tensors and the
    # allgather's (L-1) shards
    assert stats[0]["local_bytes"] == dense * (per - 1) // per + dense // per * (per - 1)
    # the reduce-scatter, the exchange between nodes (integer sums: the scales' max, then
    # the codes' sum), the allgather
    assert stats[0]["collectives"] == 2 + (2 if comp.integer_sum else 1)


def test_error_feedback_keeps_what_each_shard_did_not_send():
    """Over steps, sent + residuals = everything the nodes summed (nothing lost)."""
    nodes, per, steps = 2, 2, 4
    runs, comps = _run("topk:ratio=0.1", nodes, per, steps=steps, average=False)
    total_sent = [sum(run[0][0][i] for run in runs) for i in range(len(SHAPES))]
    total_in = [sum(_grads(r, s)[i] for r in range(nodes * per) for s in range(steps))
                for i in range(len(SHAPES))]
    for i, (name, shape) in enumerate(SHAPES.items()):
        n = int(np.prod(shape))
        k = shard_length(n, per)
        left = np.zeros(k * per, np.float32)
        for r, comp in enumerate(comps):  # the residuals, each worker's shard's
            li = r % per
            left[li * k:(li + 1) * k] += comp.states[shard_name(name, li, per)]["residual"]
        np.testing.assert_allclose(total_sent[i].reshape(-1) + left[:n], total_in[i].reshape(-1),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["signsgd", "signsgd:sum=int", "topk:ratio=0.2"])
def test_predivide_leaves_the_average_as_it_is(spec):
    """``gradient_predivide_factor`` divides before the node's sum and multiplies back after;
    a majority vote (which does not scale with its inputs) is not multiplied."""
    plain, _ = _run(spec, 2, 2, steps=2)
    pre, _ = _run(spec, 2, 2, steps=2, predivide=4.0)
    for (a, _), (b, _) in zip(plain, pre):
        for x, y in zip(a[0], b[0]):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
