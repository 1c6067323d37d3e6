"""Bodies for tests/test_tensorflow_twophase.py: our tape with ``exchange="two-phase"``
under horovodrun, eagerly and traced, against the numpy definition
(:mod:`hvd_compress.core.twophase`)."""

from __future__ import annotations

import numpy as np

from hvd_compress.core import build
from hvd_compress.core.twophase import reference, takes_two_phase
from tests.workers.tf_tape import _batch, _model, tape_step

# deterministic encoders (TensorFlow draws its own noise)
SPECS = ["topk:ratio=0.1", "dgc:ratio=0.05", "onebit"]


def tape_matches_definition(specs=SPECS, steps=2):
    """Per spec, eagerly and traced: the tape's averaged gradients against the definition,
    the tensors that cannot take it against the flat engine's (their own average)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = {}
    for spec in specs:
        for traced in (False, True):
            model = _model(tf)
            comp = hct.compressor(spec)
            refs = [build(spec, rank=r, world_size=size) for r in range(size)]
            tapes = []
            step_fn = tape_step(tf, hct, model, loss_fn, comp, tapes, exchange="two-phase")
            fn = tf.function(step_fn) if traced else step_fn
            worst, where = 0.0, None
            names = [v.name for v in model.trainable_variables]
            two = [v.name for v in model.trainable_variables
                   if takes_two_phase(refs[0], tuple(int(d) for d in v.shape), size)]
            for step in range(steps):
                x, y = _batch(tf, rank, step)
                local, got = fn(x, y)
                everyone = hvd.allgather_object({n: g.numpy() for n, g in zip(names, local)})
                expect = dict(zip(two, reference(refs, [[e[n] for n in two] for e in everyone],
                                                 two)))
                for name, g in zip(names, got):
                    if name not in expect:
                        continue
                    diff = float(np.max(np.abs(g.numpy().astype(np.float64) - expect[name])))
                    if diff > worst:
                        worst, where = diff, f"{name} step {step}"
            stats = tapes[-1].last_stats
            plan = {r.name: r.exchange for r in tapes[-1].plan(model.trainable_variables)}
            report[f"{spec}|{'traced' if traced else 'eager'}"] = {"plan": plan,
                "max_diff": worst, "worst_at": where, "two_phase": two,
                "engine": type(tapes[-1]._engine).__name__,
                "wire_in": int(stats["wire_in"]) if not traced else None}
    return {"rank": rank, "report": report}
