"""Bodies for tests/test_policy.py, run under horovodrun -np 2: per-tensor plans.

Every check compares with the numpy core: each rank's local gradients are
gathered and each tensor's own compressor is replayed in numpy
(:class:`~tests.workers.reference.Reference`, one per spec of the plan).
"""

from __future__ import annotations

import io

import numpy as np

MAPPING = {"fc1.*": "topk:ratio=0.1", "fc2.weight": "onebit", "*": "fp16"}


def _torch_setup():
    import horovod.torch as hvd
    import torch

    from tests.workers.torch_opt import batch, loss_fn, make_model
    hvd.init()
    return hvd, torch, batch, loss_fn, make_model


def _local_grads(torch, model, x, y, loss_fn):
    params = [(n, p) for n, p in model.named_parameters() if n.split(".")[0] != "unused"]
    grads = torch.autograd.grad(loss_fn(model, x, y), [p for _, p in params])
    return {n: g.detach().numpy().copy() for (n, _), g in zip(params, grads)}


def _reference_step(refs, plan, grads_by_rank, shapes):
    """``refs``: spec -> Reference; the averaged aggregate of every tensor."""
    out = {}
    for spec, ref in refs.items():
        names = [n for n, s in plan.items() if s == spec]
        if names:
            got = ref.step([{n: g[n] for n in names} for g in grads_by_rank],
                           [{} for _ in grads_by_rank])
            out.update({n: np.asarray(v).reshape(shapes[n]) for n, v in got.items()})
    return out


def torch_checks():
    hvd, torch, batch, loss_fn, make_model = _torch_setup()
    import hvd_compress.torch as hc
    from tests.workers.reference import Reference
    rank, size = hvd.rank(), hvd.size()
    res = {}

    # 1. a mixed plan aggregates to each tensor's own compressor (three steps: state)
    model = make_model()
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=MAPPING, min_numel=100)
    rows = {r["name"]: r for r in opt.plan()}
    plan = {n: r["compression"] for n, r in rows.items() if not n.startswith("unused")}
    res["plan"] = {n: r["compression"].split(":")[0] for n, r in rows.items()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    refs = {s: Reference(s, size) for s in set(plan.values())}
    errs, collectives = [], []
    for step in range(3):
        x, y = batch(rank, step)
        mine = _local_grads(torch, model, x, y, loss_fn)
        every = hvd.allgather_object(mine)
        want = _reference_step(refs, plan, every, shapes)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.synchronize()
        collectives.append(opt.last_stats["collectives"])
        for n, p in model.named_parameters():
            if n in want:
                diff = np.linalg.norm(p.grad.numpy() - want[n])
                errs.append((float(diff / max(np.linalg.norm(want[n]), 1e-30)), n))
        with opt.skip_synchronize():
            opt.step()
    res["mixed_max_err"] = max(errs)[0]
    res["mixed_errs"] = errs
    # compressed tensors alone, the uncompressed ones (and unused's zeros) in one collective
    res["collectives"] = collectives
    res["compressed"] = sum(1 for r in rows.values() if r["compressed"])

    # 2. checkpoint: torch.save/torch.load (weights_only) and resume bit-identically
    def run(m, o, steps, start):
        for step in range(start, start + steps):
            x, y = batch(rank, step)
            o.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()

    def fresh():
        m = make_model()
        return m, hc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                          named_parameters=m.named_parameters(),
                                          compression=MAPPING, min_numel=100, start_step=1)

    m1, o1 = fresh()
    run(m1, o1, 2, 0)
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "opt": o1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)  # PyTorch's default weights_only=True
    m2, o2 = fresh()
    m2.load_state_dict(saved["model"])
    o2.load_state_dict(saved["opt"])
    run(m1, o1, 2, 2)
    run(m2, o2, 2, 2)
    res["resume_identical"] = all(torch.equal(a, b) for a, b in
                                  zip(m1.parameters(), m2.parameters()))

    # 3. start_step=2: two steps equal uncompressed training exactly; the third is a
    #    fresh compressor's first step
    ma, mb = make_model(), make_model()
    oa = hc.DistributedOptimizer(torch.optim.SGD(ma.parameters(), lr=0.1),
                                 named_parameters=ma.named_parameters(),
                                 compression="topk:ratio=0.1", start_step=2)
    ob = hc.DistributedOptimizer(torch.optim.SGD(mb.parameters(), lr=0.1),
                                 named_parameters=mb.named_parameters(), compression="none")
    run(ma, oa, 2, 0)
    run(mb, ob, 2, 0)
    res["start_equal_dense"] = all(torch.equal(a, b) for a, b in
                                   zip(ma.parameters(), mb.parameters()))
    x, y = batch(rank, 2)
    every = hvd.allgather_object(_local_grads(torch, ma, x, y, loss_fn))
    want = Reference("topk:ratio=0.1", size).step(
        [{"fc1.weight": g["fc1.weight"]} for g in every], [{} for _ in every])["fc1.weight"]
    oa.zero_grad()
    loss_fn(ma, x, y).backward()
    oa.synchronize()
    res["start_then_fresh_err"] = float(np.max(np.abs(ma.fc1.weight.grad.numpy() - want)))
    res["start_sent_compressed"] = oa.last_stats["bytes_sent"] < sum(
        p.numel() * 4 for n, p in ma.named_parameters() if not n.startswith("unused"))
    with oa.skip_synchronize():
        oa.step()

    # 4. DGC plans keep momentum on the uncompressed tensors: with every tensor under the
    #    rule, the model trains exactly as SGD with momentum on the averaged gradients
    md, ms = make_model(), make_model()
    od = hc.DistributedOptimizer(torch.optim.SGD(md.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=md.named_parameters(), compression="dgc",
                                 min_numel=10 ** 9)
    os_ = hc.DistributedOptimizer(torch.optim.SGD(ms.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=ms.named_parameters(), compression="none")
    run(md, od, 3, 0)
    run(ms, os_, 3, 0)
    res["dgc_dense_err"] = max(float(torch.max(torch.abs(a - b)))
                               for a, b in zip(md.parameters(), ms.parameters()))
    res["dgc_dense_moved"] = float(torch.max(torch.abs(md.fc2.bias - make_model().fc2.bias)))

    # 5. Horovod's resume pattern (rank 0 loads, the others do not) with a delayed start:
    #    the ranks agree on the step count, so all are past start_step (no mixed phases)
    m3, o3 = fresh()  # start_step=1
    if rank == 0:
        m3.load_state_dict(saved["model"])
        o3.load_state_dict(saved["opt"])  # 2 steps done
    hvd.broadcast_parameters(m3.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(o3, root_rank=0)
    run(m3, o3, 1, 2)
    res["resumed_steps"] = o3._optimizer_steps
    res["resumed_collectives"] = o3.last_stats["collectives"]
    hvd.barrier()
    return res


def tf_checks():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    from hvd_compress.core import NumpyBackend
    from hvd_compress.tensorflow.wrapperstate import wrapper_state
    from tests.workers.reference import Reference
    numpy_tf = NumpyBackend("out_last")  # the reference in TensorFlow's layout
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    res = {}
    rng = np.random.default_rng(0)
    shapes = {"big": (40, 30), "mid": (12, 10), "vec": (30,), "tiny": (3, 3)}
    names = [f"{n}:0" for n in shapes]
    mapping = {"big*": "topk:ratio=0.1", "mid*": "onebit", "*": "fp16"}
    specs, errs = {}, []

    def grads_at(step):
        g = np.random.default_rng(100 * rank + step)
        return [g.standard_normal(s).astype("float32") for s in shapes.values()]

    for mode in ("eager", "function"):  # new variables: new state
        variables = [tf.Variable(rng.standard_normal(s).astype("float32"), name=n)
                     for n, s in shapes.items()]
        refs = None
        fn = None
        for step in range(3):
            local = grads_at(step)
            every = hvd.allgather_object(dict(zip(names, local)))

            def exchange(local=local, variables=variables):
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, local)])
                tape = hct.DistributedGradientTape(tape, compression=mapping, min_numel=100)
                return tape.gradient(loss, variables), tape

            if mode == "eager":
                got, tape = exchange()
                if step == 0:
                    rows = tape.plan(variables)
                    specs = {r["name"]: r["compression"] for r in rows}
                    res["tf_plan"] = {r["name"].split(":")[0]: r["compression"].split(":")[0]
                                      for r in rows}
                    res["tf_collectives"] = tape.last_stats["collectives"]
            else:
                if fn is None:
                    fn = tf.function(lambda *gs: exchange(list(gs))[0])
                got = fn(*[tf.constant(g) for g in local])
            if refs is None:
                refs = {s: Reference(s, size, numpy_tf) for s in set(specs.values())}
            want = _reference_step(refs, specs, every, dict(zip(names, shapes.values())))
            errs += [float(np.linalg.norm(g.numpy() - want[n]) / np.linalg.norm(want[n]))
                     for g, n in zip(got, names)]
    res["tf_mixed_max_err"] = max(errs)

    # checkpoint: a policy's compressors and its delayed-start counter round-trip through
    # tf.train.Checkpoint, restored before first use (deferred), and resume bit-identically
    import tempfile

    def train(comp, variables, steps, start):
        out = []
        for step in range(start, start + steps):
            local = grads_at(step)
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, local)])
            tape = hct.DistributedGradientTape(tape, compression=comp)
            out = [g.numpy() for g in tape.gradient(loss, variables)]
        return out

    def fresh():
        return [tf.Variable(np.ones(s, "float32"), name=n) for n, s in shapes.items()]

    first = hct.as_compression(mapping, 100, 1)
    va = fresh()
    train(first, va, 2, 0)
    path = tf.train.Checkpoint(c=first).write(tempfile.mkdtemp() + f"/rank{rank}")
    second = hct.as_compression(mapping, 100, 1)
    tf.train.Checkpoint(c=second).read(path)
    a, b = train(first, va, 2, 2), train(second, fresh(), 2, 2)
    res["tf_resume_identical"] = all(np.array_equal(x, y) for x, y in zip(a, b))
    res["tf_policy_steps"] = int(wrapper_state(second).policy_steps.numpy())

    # start_step=2 inside tf.function (tf.cond on the counter): two exchanges equal `none`,
    # the third is a fresh top-k's first
    comp = hct.as_compression("topk:ratio=0.1", 100, 2)
    vs = fresh()

    @tf.function
    def traced(*local):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(vs, local)])
        return hct.DistributedGradientTape(tape, compression=comp).gradient(loss, vs)

    diffs = []
    for step in range(3):
        local = grads_at(step)
        got = [g.numpy() for g in traced(*[tf.constant(g) for g in local])]
        every = hvd.allgather_object(dict(zip(names, local)))
        if step < 2:
            want = {n: sum(e[n] for e in every) / size for n in names}
        else:
            specs3 = {f"{n}:0": ("topk:ratio=0.1" if int(np.prod(s)) >= 100 else "none")
                      for n, s in shapes.items()}
            refs3 = {s: Reference(s, size, numpy_tf) for s in set(specs3.values())}
            want = _reference_step(refs3, specs3, every, dict(zip(names, shapes.values())))
        diffs.append(max(float(np.max(np.abs(g - want[n]))) for g, n in zip(got, names)))
    res["tf_start_step_errs"] = diffs

    # a compressor object given to the tape keeps its accumulators and counters even when
    # the default rule wraps it in a policy (a checkpoint of that object holds them)
    comp = hct.compressor("topk:ratio=0.1")
    v = [tf.Variable(tf.ones([40, 30]), name="w"), tf.Variable(tf.ones([5]), name="b")]
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v[0] * v[0]) + tf.reduce_sum(v[1])
        tape = hct.DistributedGradientTape(tape, compression=comp, backward_passes_per_step=2)
        tape.gradient(loss, v)
    res["given_is_policy"] = isinstance(tape.compression, hct.TFPolicy)
    res["given_passes"] = int(wrapper_state(comp).passes.numpy())
    res["given_accs"] = sorted(wrapper_state(comp).sums) == sorted([v[0].name, v[1].name])
    # ... and a checkpoint of that object holds them
    saved = tf.train.Checkpoint(c=comp).write(tempfile.mkdtemp() + f"/given{rank}")
    names = [n for n, _ in tf.train.list_variables(saved)]
    res["given_checkpointed"] = any(n.startswith("c/counters/passes") for n in names) and \
        sum(n.startswith("c/accumulators/") for n in names) == 2
    try:
        hct.DistributedGradientTape(tf.GradientTape(), compression="topk", start_step=2, delay=1)
        res["given_refused"] = ""
    except ValueError as e:
        res["given_refused"] = str(e)
    hvd.allreduce(tf.constant(0.0), name="policy.done")  # every rank finishes together
    return res
