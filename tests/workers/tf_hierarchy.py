"""Bodies for tests/test_tensorflow_hierarchy.py: our tape and Keras optimizer under 2
simulated nodes of 2 workers (hvd_compress.tools.nodesrun), node process sets at init."""

from __future__ import annotations

import numpy as np

from hvd_compress.core import build
from tests.workers.reference import hierarchical_step
from tests.workers.tf_tape import _batch, _model, tape_step

# (an integer sum without noise: TensorFlow draws its own, which numpy cannot repeat)
SPECS = ["topk:ratio=0.1", "dgc:ratio=0.05", "onebit", "none", "signsgd:sum=int"]


def tape_matches_definition(specs=SPECS, steps=2):
    """Per spec, eagerly and traced: the tape's averaged gradients against the numpy
    reference of the hierarchical exchange, and the account's bytes between nodes."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    from hvd_compress import nodes
    hvd.init(process_sets=nodes.node_process_sets())
    rank, size = hvd.rank(), hvd.size()
    n_nodes, per = hvd.cross_size(), hvd.local_size()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = {}
    for spec in specs:
        for traced in (False, True):
            model = _model(tf)
            comp = hct.compressor(spec)
            comps = [build(spec, rank=r, world_size=size) for r in range(size)]
            tapes = []
            step_fn = tape_step(tf, hct, model, loss_fn, comp, tapes)
            fn = tf.function(step_fn) if traced else step_fn
            worst = 0.0
            for step in range(steps):
                x, y = _batch(tf, rank, step)
                local, got = fn(x, y)
                names = [v.name for v in model.trainable_variables]
                everyone = hvd.allgather_object({n: g.numpy() for n, g in zip(names, local)})
                expect = hierarchical_step(comps, everyone, n_nodes, per)
                for name, g in zip(names, got):
                    value = expect[name]
                    diff = float(np.max(np.abs(g.numpy().astype(np.float64) - value)))
                    worst = max(worst, diff / max(1e-6, float(np.max(np.abs(value)))))
            engine = tapes[-1]._engine
            stats = tapes[-1].last_stats
            report[f"{spec}|{'traced' if traced else 'eager'}"] = {
                "hierarchical": type(engine).__name__ == "TFHierarchical", "rel_err": worst,
                "bytes_sent": int(stats["bytes_sent"]) if not traced else None,
                "local_bytes": int(stats["local_bytes"]) if not traced else None,
                "formula_bytes": _formula_bytes(spec, model, per)}
    return {"rank": rank, "report": report}


def _formula_bytes(spec, model, per):
    """What a worker sends in one step by the definition: between nodes, each sharded
    tensor's shard payload (a ``(ceil(n/L), 1)`` matrix for 2+ dimensions, as in
    tests/workers/torch_hierarchy.py); a tensor that goes flat, its whole payload."""
    from hvd_compress.core.hierarchy import shard_length, sharded
    comp = build(spec)
    want = 0
    for v in model.trainable_variables:
        shape = tuple(int(d) for d in v.shape)
        if sharded(comp):
            k = shard_length(int(np.prod(shape)), per)
            shape = (k, 1) if len(shape) >= 2 else (k,)
        want += comp.payload_nbytes(comp.meta_for(np.zeros(shape, np.float32), v.name))
    return int(want)
