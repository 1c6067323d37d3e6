"""Bodies for tests/test_ddp_hook.py: the DDP communication hook in a Gloo process group.

Launched under ``mpirun -np N`` (the rank from Open MPI's environment; the process group
is torch.distributed's Gloo over TCP, and Horovod is initialised beside it, over MPI, for
the Horovod path to compare with).  Every body builds small models (the same parameters
on every rank), feeds rank- and step-seeded batches and returns what the test asserts:

* ``reference``: the hook's averaged gradients against the numpy core replaying every
  rank's compressor (:class:`~tests.workers.reference.Reference`, the Horovod optimizer's
  multi-rank reference), over several steps;
* ``horovod``: against ``hvd_compress.torch.DistributedOptimizer`` on the same batches;
* ``fp16`` / ``powersgd``: against PyTorch's own ``fp16_compress_hook`` and
  ``powerSGD_hook``;
* ``checkpoint``: state_dict / pickle round trips give the same next step;
* ``bucket_views``: DDP's bucket rebuild (one bucket, then two) and bucket views;
* ``two_phase``, ``delayed``, ``mismatch``, ``collectives``: the two-phase exchange,
  ``start_step``, ranks set up differently, and the collectives themselves.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.workers.reference import Reference
from tests.workers.torch_opt import host, record_noise

SPECS = ["fp16", "topk:ratio=0.1", "onebit", "qsgd:levels=7", "powersgd:rank=2",
         "thresholdv:tau=0.01", "qsgd:sum=int,levels=5"]
#: (no stochastic rounding: its noise is drawn in encoding order, DDP's bucket order here,
#: the gradient hooks' order there; same distribution, other bits)
HOROVOD_SPECS = ["fp16", "topk:ratio=0.1", "randomk:ratio=0.1", "dgc:ratio=0.1,momentum=0.9",
                 "powersgd:rank=2"]
STEPS = 2
#: where models, batches and gradients live (``run(device="cuda")``: this rank's GPU)
DEVICE = torch.device("cpu")


def make_model(seed=0, sizes=(12, 16, 4)):
    torch.manual_seed(seed)
    a, b, c = sizes
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh(),
                               torch.nn.Linear(b, c)).to(DEVICE)


def batch(rank, step, n=6, sizes=(12, 16, 4)):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + 7)
    return (torch.randn(n, sizes[0], generator=g).to(DEVICE),
            torch.randn(n, sizes[-1], generator=g).to(DEVICE))


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def local_grads(model, x, y) -> dict:
    named = list(model.named_parameters())
    grads = torch.autograd.grad(loss_fn(model, x, y), [p for _, p in named])
    return {n: host(g).copy() for (n, _), g in zip(named, grads)}


def wrap(model):
    """``model`` in DDP (on this rank's GPU where the models are on one)."""
    return DDP(model, device_ids=None if DEVICE.type == "cpu" else [DEVICE.index])


def hooked(spec, model=None, named=True, **knobs):
    """A DDP over a fresh model (or ``model``) with our hook; ``(ddp, model, state)``."""
    import hvd_compress.torch as hc
    model = make_model() if model is None else model
    ddp = wrap(model)
    state, hook = hc.ddp_comm_hook(spec, named_parameters=model.named_parameters()
                                   if named else None, **{"min_numel": 0, **knobs})
    ddp.register_comm_hook(state, hook)
    return ddp, model, state


def backward(ddp, model, x, y) -> dict:
    """One DDP backward pass: the averaged gradients the hook left, by name."""
    model.zero_grad(set_to_none=True)
    loss_fn(ddp, x, y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def digest(grads: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(grads):
        h.update(host(grads[name]).tobytes())
    return h.hexdigest()


def agree(grads: dict) -> bool:
    """Whether every rank holds these gradients, bit for bit."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest(grads))
    return len(set(every)) == 1


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(1e-30, float(np.max(np.abs(b)))))


def against_reference(specs=SPECS, steps=STEPS) -> dict:
    """Per spec and step: the worst relative difference from the numpy reference, whether
    the hook's bits equal the reference's, whether the ranks agree, and (step >= 1) how
    far the reference without the earlier steps' state is (error feedback carried)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    out = {}
    for spec in specs:
        ddp, model, state = hooked(spec)
        log = record_noise(SimpleNamespace(compression=state.compression))
        ref = Reference(spec, size)
        rows = []
        for step in range(steps):
            x, y = batch(rank, step)
            mine = local_grads(model, x, y)
            log.clear()
            got = backward(ddp, model, x, y)
            every = [None] * size
            dist.all_gather_object(every, (mine, dict(log)))
            grads, noises = [e[0] for e in every], [e[1] for e in every]
            want = ref.step(grads, noises)
            fresh = Reference(spec, size).step(grads, noises)  # no earlier steps' state
            rows.append({"rel": max(rel(host(got[n]), want[n]) for n in want),
                         "same_bits": all(np.array_equal(host(got[n]), want[n]) for n in want),
                         "stateless_rel": max(rel(want[n], fresh[n]) for n in want),
                         "ranks_agree": agree(got)})
        out[spec] = {"steps": rows, "iter": state.iter, "totals": dict(state.totals),
                     "compression_stats": list(state.compression_stats()),
                     "last": dict(state.last_stats),
                     "dense_bytes": 4 * sum(p.numel() for p in model.parameters())}
    return out


def against_horovod(specs=HOROVOD_SPECS, steps=STEPS) -> dict:
    """Per spec: the worst relative difference between the hook's gradients and those
    ``hvd_compress.torch.DistributedOptimizer`` leaves on the same batches (exchange
    ``allgather``), and whether every step's were the same bits."""
    import hvd_compress.torch as hc
    rank = dist.get_rank()
    out = {}
    for spec in specs:
        ddp, model, state = hooked(spec)
        theirs = make_model()
        opt = hc.DistributedOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.1),
                                      named_parameters=theirs.named_parameters(),
                                      compression=spec, min_numel=0, exchange="allgather")
        worst, same = 0.0, True
        for step in range(steps):
            x, y = batch(rank, step)
            got = backward(ddp, model, x, y)
            opt.zero_grad()
            loss_fn(theirs, x, y).backward()
            opt.synchronize()
            for n, p in theirs.named_parameters():
                worst = max(worst, rel(host(got[n]), host(p.grad)))
                same = same and torch.equal(got[n], p.grad)
        out[spec] = {"rel": worst, "same_bits": same,
                     "bytes": [state.totals["bytes_sent"], opt.comm_totals["bytes_sent"]]}
    return out


def against_torch_fp16(steps=STEPS) -> dict:
    """Our ``fp16`` against ``default_hooks.fp16_compress_hook`` on the same batches, both
    against the exact mean (float64): PyTorch divides each rank's float16 gradient by
    ``p`` before the float16 sum, ours sums the float16 payloads and scales the float32
    sum by ``1/p``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    rank, size = dist.get_rank(), dist.get_world_size()
    ddp, model, _ = hooked("fp16")
    theirs = make_model()
    tddp = wrap(theirs)
    tddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    res = {"equal": 0, "normal_equal": 0, "normal": 0, "count": 0, "rel_ours_theirs": 0.0,
           "rel_ours_exact": 0.0, "rel_theirs_exact": 0.0}
    for step in range(steps):
        x, y = batch(rank, step)
        every = [None] * size
        dist.all_gather_object(every, local_grads(model, x, y))
        ours, tgot = backward(ddp, model, x, y), backward(tddp, theirs, x, y)
        for n in ours:
            exact = sum(e[n].astype(np.float64) for e in every) / size
            a, b = host(ours[n]), host(tgot[n])
            # where every rank's gradient / p is a normal float16 (no subnormal rounding)
            normal = np.all([np.abs(e[n]) / size >= 2.0 ** -14 for e in every], axis=0)
            res["count"] += a.size
            res["equal"] += int(np.sum(a == b))
            res["normal"] += int(np.sum(normal))
            res["normal_equal"] += int(np.sum((a == b) & normal))
            res["rel_ours_theirs"] = max(res["rel_ours_theirs"], rel(a, b))
            res["rel_ours_exact"] = max(res["rel_ours_exact"], rel(a, exact))
            res["rel_theirs_exact"] = max(res["rel_theirs_exact"], rel(b, exact))
    return res


def against_torch_powersgd(steps=STEPS) -> dict:
    """Our ``powersgd`` against ``powerSGD_hook`` where both are exact: one sample per rank,
    so each rank's weight gradients have rank 1 and their mean rank at most ``p``, which a
    rank-``p`` approximation reproduces (P spans the mean's columns: both hooks return the
    mean up to rounding, whatever Q each draws).  Error feedback and warm start off on
    both sides (with them, PyTorch's hook runs uncompressed until ``start_powerSGD_iter
    >= 2``, and each side's result depends on its own Q's history); both compress from
    the first step.  tests/test_powersgd_oracle.py compares them with error feedback and
    warm start, given the same Q."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    rank, size = dist.get_rank(), dist.get_world_size()
    sizes = (24, 32, 20)
    ddp, model, state = hooked(f"powersgd:rank={size},ef=false,warm_start=false",
                               model=make_model(sizes=sizes))
    theirs = make_model(sizes=sizes)
    tddp = wrap(theirs)
    tstate = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=size,
                                start_powerSGD_iter=0, min_compression_rate=1,
                                use_error_feedback=False, warm_start=False,
                                orthogonalization_epsilon=0, random_seed=0)
    tddp.register_comm_hook(tstate, psgd.powerSGD_hook)
    res = {"steps": [], "dense_bytes": 4 * sum(p.numel() for p in model.parameters())}
    for step in range(steps):
        x, y = batch(rank, step, n=1, sizes=sizes)
        every = [None] * size
        dist.all_gather_object(every, local_grads(model, x, y))
        ours, tgot = backward(ddp, model, x, y), backward(tddp, theirs, x, y)
        exact = {n: sum(e[n].astype(np.float64) for e in every) / size for n in ours}
        res["steps"].append({
            "ours_exact": max(rel(host(ours[n]), exact[n]) for n in ours),
            "theirs_exact": max(rel(host(tgot[n]), exact[n]) for n in ours),
            "ours_theirs": max(rel(host(ours[n]), host(tgot[n])) for n in ours),
            "ours_bytes": state.last_stats["bytes_sent"]})
    res["theirs_compression"] = list(tstate.compression_stats())
    return res


def checkpoint_round_trip(specs=("topk:ratio=0.1+qsgd:levels=16", "powersgd:rank=2"),
                          warm=2) -> dict:
    """After ``warm`` steps, the state through ``torch.save`` / ``torch.load(weights_only=
    True)`` into a new state, and through pickle: the next step on new DDPs over the same
    parameters, against the original state's next step on another such DDP (its new
    parameters named with ``name_parameters``; the loaded states name unnamed ones in
    the order the checkpoint saw them), and against a fresh state, which must differ.
    All on new DDPs: a new DDP hands its first iteration's buckets in another order than
    the rebuilt ones, and the order is part of the bits (stochastic rounding draws its
    noise in encoding order; at 3 ranks and more a summed payload's layout changes
    Gloo's order of addition).  ``powersgd`` runs unnamed (``param<k>`` names)."""
    rank = dist.get_rank()
    import hvd_compress.torch as hc
    out = {}

    def step_with(state, x, y, names=None):
        model = make_model()
        if names is not None:  # the original state's names for the new parameters
            state.name_parameters(zip(names, model.parameters()))
        ddp = wrap(model)
        ddp.register_comm_hook(state, hc.compression_hook)
        return backward(ddp, model, x, y)

    for spec in specs:
        named = not spec.startswith("powersgd")
        ddp, model, state = hooked(spec, named=named)
        for step in range(warm):
            backward(ddp, model, *batch(rank, step))
        buf = io.BytesIO()
        torch.save(state.state_dict(), buf)
        pickled = pickle.dumps(state)
        buf.seek(0)
        loaded_model = make_model()  # (the same parameters: no optimizer steps here)
        loaded = hc.DDPCompressionState(spec, named_parameters=loaded_model.named_parameters()
                                        if named else None, min_numel=0)
        loaded.load_state_dict(torch.load(buf, weights_only=True))
        unpickled = pickle.loads(pickled)
        x, y = batch(rank, warm)
        names = [n for n, _ in model.named_parameters()] if named else \
            state.state_dict()["seen"]  # (unnamed: in the order DDP's first buckets held them)
        want = step_with(state, x, y, names)
        ldp = wrap(loaded_model)
        ldp.register_comm_hook(loaded, hc.compression_hook)
        got = backward(ldp, loaded_model, x, y)
        from_pickle = step_with(unpickled, x, y)
        fresh = step_with(hc.DDPCompressionState(spec, min_numel=0), x, y)
        out[spec] = {"same": all(torch.equal(got[n], want[n]) for n in want),
                     "pickle_same": all(torch.equal(from_pickle[n], want[n]) for n in want),
                     "fresh_differs": any(not torch.equal(fresh[n], want[n]) for n in want),
                     "iter": [state.iter, loaded.iter, unpickled.iter]}
    return out


def two_phase(spec="topk:ratio=0.1", steps=STEPS) -> dict:
    """``exchange="two-phase"`` against :func:`hvd_compress.core.twophase.reference`."""
    from hvd_compress.core import build
    from hvd_compress.core.twophase import reference
    rank, size = dist.get_rank(), dist.get_world_size()
    ddp, model, state = hooked(spec, exchange="two-phase")
    workers = [build(spec, rank=r, world_size=size) for r in range(size)]
    names = [n for n, _ in model.named_parameters()]
    worst, agreed = 0.0, True
    for step in range(steps):
        x, y = batch(rank, step)
        every = [None] * size
        dist.all_gather_object(every, local_grads(model, x, y))
        got = backward(ddp, model, x, y)
        want = reference(workers, [[e[n] for n in names] for e in every], names)
        worst = max([worst] + [rel(host(got[n]), w) for n, w in zip(names, want)])
        agreed = agreed and agree(got)
    res = {"rel": worst, "ranks_agree": agreed, "collectives": state.last_stats["collectives"]}
    return res


def delayed(spec="topk:ratio=0.1", steps=2) -> dict:
    """``start_step=1`` with ``min_numel=100``: iteration 0 sends every gradient dense (the
    exact mean), then the weights travel compressed and the biases dense."""
    rank, size = dist.get_rank(), dist.get_world_size()
    ddp, model, state = hooked(spec, start_step=1, min_numel=100)
    res = {"bytes": [], "first_rel": None}
    for step in range(steps):
        x, y = batch(rank, step)
        every = [None] * size
        dist.all_gather_object(every, local_grads(model, x, y))
        got = backward(ddp, model, x, y)
        if step == 0:
            res["first_rel"] = max(rel(host(got[n]), sum(e[n].astype(np.float64) for e in every)
                                       / size) for n in got)
        res["bytes"].append(state.last_stats["bytes_sent"])
    res["dense_bytes"] = 4 * sum(p.numel() for p in model.parameters())
    return res


def bucket_views(spec="topk:ratio=0.1", steps=3) -> dict:
    """``gradient_as_bucket_view=True`` (the gradients are the bucket's views) and a small
    ``bucket_cap_mb``: DDP's first iteration hands one bucket, its rebuilt buckets are two
    (bucket 0 then holds other parameters) -- the same gradients as one bucket throughout
    (state kept by parameter name, not bucket index)."""
    rank = dist.get_rank()
    import hvd_compress.torch as hc
    ddp, model, _ = hooked(spec)
    vmodel = make_model()
    vddp = DDP(vmodel, gradient_as_bucket_view=True, bucket_cap_mb=0.0002,
               device_ids=None if DEVICE.type == "cpu" else [DEVICE.index])
    vstate = hc.DDPCompressionState(spec, named_parameters=vmodel.named_parameters(),
                                    min_numel=0)
    calls = []

    def counted(state, bucket):
        calls.append(bucket.index())
        return hc.compression_hook(state, bucket)

    vddp.register_comm_hook(vstate, counted)
    same = True
    for step in range(steps):
        x, y = batch(rank, step)
        want, got = backward(ddp, model, x, y), backward(vddp, vmodel, x, y)
        same = same and all(torch.equal(got[n], want[n]) for n in want)
    return {"same": same, "buckets": len(set(calls)), "calls": len(calls),
            "iter": vstate.iter}


def mismatch() -> dict:
    """Ranks set up with different compressors: the first bucket's plan check raises
    :class:`~hvd_compress.core.agreement.PlanMismatchError` on every rank (no hang)."""
    spec = "topk:ratio=0.1" if dist.get_rank() == 0 else "onebit"
    ddp, model, _ = hooked(spec)
    try:
        backward(ddp, model, *batch(dist.get_rank(), 0))
    except Exception as exc:  # (DDP's autograd engine passes the hook's error on)
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def collectives() -> dict:
    """:class:`~hvd_compress.torch.torchdist.TorchDistributed` itself: rows of different
    lengths, an alltoall of uneven splits, the maximum, the reduce-scatter."""
    from hvd_compress.core.exchange import MAX
    from hvd_compress.torch.torchdist import TorchDistributed
    coll = TorchDistributed()
    r, p = coll.rank, coll.size
    d = {"device": DEVICE}
    rows = coll.wait(coll.allgather(torch.arange(r + 2, dtype=torch.uint8, **d) + r, "rows"))
    splits = [(r + j) % 3 for j in range(p)]  # to rank j: r + j values (mod 3) of value 10 r + j
    flat = torch.cat([torch.full((k,), 10 * r + j, dtype=torch.int32, **d)
                      for j, k in enumerate(splits)])
    got, got_splits = coll.wait(coll.alltoall(flat, splits, "a2a"))
    want_splits = [(q + r) % 3 for q in range(p)]
    want = torch.cat([torch.full((k,), 10 * q + r, dtype=torch.int32, **d)
                      for q, k in enumerate(want_splits)])
    biggest = coll.wait(coll.allreduce(torch.tensor([r, -r], dtype=torch.float32, **d), "max",
                                       op=MAX))
    part = coll.wait(coll.reducescatter(torch.arange(2 * p, dtype=torch.float32, **d), "rs"))
    # host tensors (the plan agreement's bytes) on any backend (NCCL moves CUDA tensors
    # only): they travel by a device the backend takes and come back to the host
    host = coll.wait(coll.allgather(torch.arange(3, dtype=torch.uint8) + r, "host"))
    hsum = coll.wait(coll.allreduce(torch.ones(2), "hsum"))
    hgot, _ = coll.wait(coll.alltoall(torch.full((p,), r, dtype=torch.int64), [1] * p, "ha2a"))
    return {"host": all(x.device.type == "cpu" for x in [*host, hsum, hgot])
            and all(torch.equal(row, torch.arange(3, dtype=torch.uint8) + q)
                    for q, row in enumerate(host))
            and hsum.tolist() == [float(p)] * 2 and hgot.tolist() == list(range(p)),
            "rows": all(torch.equal(row, torch.arange(q + 2, dtype=torch.uint8, **d) + q)
                        for q, row in enumerate(rows)) and len(rows) == p,
            "alltoall": torch.equal(got, want) and got_splits == want_splits,
            "max": biggest.tolist() == [p - 1, 0],
            "reducescatter": part.tolist() == [float(p * (2 * r)), float(p * (2 * r + 1))]}


BODIES = {"collectives": collectives, "reference": against_reference,
          "horovod": against_horovod, "fp16": against_torch_fp16,
          "powersgd": against_torch_powersgd, "checkpoint": checkpoint_round_trip,
          "two_phase": two_phase, "delayed": delayed, "bucket_views": bucket_views,
          "mismatch": mismatch}


def run(port, only=None, device="cpu") -> dict:
    """Every body (or those named in ``only``) in one process group: one launch per world
    size.  ``device="cuda"``: rank r on GPU ``r % count`` and NCCL where every rank has a
    GPU of its own, else Gloo (ranks sharing a GPU)."""
    global DEVICE
    import horovod.torch as hvd
    torch.set_num_threads(1)
    # mpirun here; horovodrun --gloo on the GPU machines (no MPI there)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("HOROVOD_SIZE", "1")))
    backend = "gloo"
    if device == "cuda":
        DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    hvd.init()
    try:
        out = {"rank": rank, "seconds": {}, "backend": backend}
        for key, body in BODIES.items():
            if only is None or key in only:
                t0 = time.perf_counter()
                out[key] = body()
                out["seconds"][key] = round(time.perf_counter() - t0, 2)
    finally:
        dist.destroy_process_group()
    return out
