"""Bodies for tests/test_torch_multiprocess.py, run under horovodrun -np 2.

The reference for every check is the numpy core: each rank's local gradient
(computed separately, before the optimizer's hooks see it) and the noise the
torch compressor drew are gathered, every rank's compressor is replayed in
numpy, and the aggregate is compared with the gradient the optimizer left.
"""

from __future__ import annotations

import numpy as np
import torch

from hvd_compress.core import build
from tests.workers.reference import Reference

SPECS = ["none", "fp16", "bf16", "topk:ratio=0.1", "randomk:ratio=0.1",
         "randomk:ratio=0.2,unbiased=true", "dgc:ratio=0.05,momentum=0.9", "qsgd:levels=7",
         "terngrad", "onebit", "threshold:tau=0.001", "powersgd:rank=2",
         "topk:ratio=0.1+qsgd:levels=16", "randomk:ratio=0.1+fp16", "randomk:ratio=0.1+bf16",
         "dgc:ratio=0.05+onebit", "signsgd", "signum", "efsignsgd", "natural", "uniform",
         "eightbit", "sketchml", "thresholdv:tau=0.005", "adaq:ratio=0.2",
         "inceptionn:bound=1e-4", "terngrad:sum=int", "qsgd:sum=int,levels=5", "signsgd:sum=int"]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.fc1 = torch.nn.Linear(4 * 6 * 6, 24)
        self.fc2 = torch.nn.Linear(24, 5)
        self.unused = torch.nn.Linear(3, 3)  # gets a gradient only when asked

    def forward(self, x, use_extra=False):
        h = torch.relu(self.conv(x)).flatten(1)
        out = self.fc2(torch.relu(self.fc1(h)))
        if use_extra:
            out = out + self.unused(out[:, :3]).sum()
        return out


def make_model(device="cpu"):
    torch.manual_seed(0)
    return Net().to(device)


def use_device(device):
    """``device`` for this rank after ``hvd.init()``: ``"cuda"`` takes the GPU of the
    rank's local index (modulo the GPUs there: ranks may share one)."""
    if device != "cuda":
        return torch.device(device)
    import horovod.torch as hvd
    index = hvd.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    # bit-identical resumes need the same convolution algorithms every launch
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return torch.device("cuda", index)


def batch(rank, step, micro=0, device="cpu"):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
    return x.to(device), y.to(device)


def host(t):
    """A tensor's values as a numpy array (copied off the GPU where it lives there)."""
    return t.detach().cpu().numpy()


def loss_fn(model, x, y, use_extra=False):
    return torch.nn.functional.cross_entropy(model(x, use_extra), y)


def record_noise(opt):
    """Make the compressor record the noise it draws, per (tensor name, call)."""
    core = opt.compression.core
    log = []
    if getattr(core, "noise", None) is None:
        return log
    original = core.encode

    def encode(x, name="", noise=None):
        meta = core.meta_for(x, name)
        n = core.k_for(meta) if hasattr(core, "k_for") else meta.numel
        # (a copy: the host generator hands out one buffer for every draw, and the
        # integer sums keep theirs until round 1)
        noise = core.noise.draw(n, like=x.reshape(-1)).clone()
        log.append((name, host(noise).copy()))
        return original(x, name, noise=noise)

    core.encode = encode
    return log


def exchange_step(opt, model, rank, step, bpps=1, log=None, device="cpu"):
    """One optimizer step of ``bpps`` backward passes on this rank's batches: ``(local,
    got, noise)`` -- the summed local gradients (computed apart, before the hooks), the
    gradients the optimizer left (its exchange's result) and the noise it drew
    (``log``: :func:`record_noise`'s)."""
    opt.zero_grad()
    log = [] if log is None else log
    log.clear()
    local = None
    for micro in range(bpps):
        x, y = batch(rank, step, micro, device)
        g = _local_grads(model, x, y)
        local = g if local is None else {k: local[k] + g[k] for k in g}
        loss_fn(model, x, y).backward()
    opt.synchronize()  # noise was drawn in the hooks (or here, for a single rank)
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    noise = {name: arr for name, arr in log}
    log.clear()
    with opt.skip_synchronize():
        opt.step()
    return local, got, noise


def _local_grads(model, x, y, use_extra=False):
    params = [(n, p) for n, p in model.named_parameters()]
    loss = loss_fn(model, x, y, use_extra)
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return {n: (g.detach().clone() if g is not None else torch.zeros_like(p))
            for (n, p), g in zip(params, grads)}


def aggregate_matches_reference(specs=SPECS, steps=2, bpps=1, device="cpu"):
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = use_device(device)
    report = {}
    for spec in specs:
        model = make_model(device)
        opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      compression=spec, backward_passes_per_step=bpps, min_numel=0)
        log = record_noise(opt)
        ref = Reference(str(opt.compression.spec), size)
        worst = 0.0
        for step in range(steps):
            local, got, noise = exchange_step(opt, model, rank, step, bpps, log, device)
            everyone = hvd.allgather_object(({k: host(v) for k, v in local.items()}, noise))
            expect = ref.step([e[0] for e in everyone], [e[1] for e in everyone])
            for name, value in expect.items():
                assert got[name].device == device, (spec, name, got[name].device)
                diff = float(np.max(np.abs(host(got[name]).astype(np.float64) - value)))
                scale = max(1e-6, float(np.max(np.abs(value))))
                worst = max(worst, diff / scale)
        stats = opt.last_stats
        report[spec] = {"rel_err": worst, "bytes_sent": stats["bytes_sent"],
                        "collectives": stats["collectives"]}
        if "powersgd" in spec:
            assert worst < 1e-3, (spec, worst)
        elif spec.endswith("bf16"):  # bf16 sums travel as float16 (Horovod cannot add bf16)
            assert worst < 2 ** -7, (spec, worst)
        else:
            assert worst < 1e-5, (spec, worst)
    # every rank ends with the same parameters
    out = {"rank": rank, "report": report}
    if any(build(s).variable_size for s in specs):
        out["different_orders"] = variable_sizes_in_different_orders(device=device)
    if any(build(s).integer_sum for s in specs):
        out["int32_wrap"] = int32_sums_wrap(device)
    return out


def int32_sums_wrap(device="cpu"):
    """Horovod's int32 sum into the sign bit and past it comes back modulo 2**32 (what
    the integer sums' lanes rely on): each rank adds 0x7F000000 and 0xC0000000."""
    import horovod.torch as hvd
    words = torch.tensor([0x7F000000, 0xC0000000 - (1 << 32), 5], dtype=torch.int32,
                         device=device)
    got = hvd.allreduce(words, op=hvd.Sum, name="int32_wrap")
    size = hvd.size()
    want = [(size * v + (1 << 31)) % (1 << 32) - (1 << 31) for v in (0x7F000000, 0xC0000000, 5)]
    return {"got": got.tolist(), "want": want}


def variable_sizes_in_different_orders(seconds=30.0, device="cpu"):
    """Two groups of variable-size payloads sent through the engine in opposite orders
    on even and odd ranks (Horovod negotiates collectives by name, in any order), then
    received: each result against the numpy reference.  A wait that outlasts ``seconds``
    raises (a send that blocked on its own row lengths deadlocked here)."""
    import time

    import horovod.torch as hvd

    from hvd_compress.core import Exchange, new_stats
    from hvd_compress.torch.backend import TorchBackend
    from hvd_compress.torch.collectives import HorovodTorch

    class Deadline(HorovodTorch):
        def wait(self, handle):
            end = time.monotonic() + seconds
            while not hvd.poll(handle):
                if time.monotonic() > end:
                    raise TimeoutError(f"rank {hvd.rank()}: a collective never completed")
                time.sleep(1e-3)
            return hvd.synchronize(handle)

    rank, size = hvd.rank(), hvd.size()
    groups = {"A": ("thresholdv:tau=0.005", {"ooo.a.weight": (30, 7), "ooo.a.bias": (7,)}),
              "B": ("adaq:ratio=0.2", {"ooo.b.weight": (50,)})}
    rng = np.random.default_rng([7, rank])
    local = {n: (rng.standard_normal(s) * 0.01).astype(np.float32)
             for _, shapes in groups.values() for n, s in shapes.items()}
    order = ["A", "B"] if rank % 2 == 0 else ["B", "A"]
    engines = {g: Exchange(build(groups[g][0], backend=TorchBackend(), rank=rank, world_size=size),
                           Deadline(hvd.global_process_set)) for g in order}
    stats = new_stats()
    batches = {g: engines[g].send([torch.from_numpy(local[n]).to(device) for n in groups[g][1]],
                                  list(groups[g][1]), stats) for g in order}
    got = {}
    for g in order:
        got.update(zip(groups[g][1], engines[g].receive(batches[g], stats)))
    everyone = hvd.allgather_object(local)
    worst = 0.0
    for spec, shapes in groups.values():
        expect = Reference(spec, size).step([{n: e[n] for n in shapes} for e in everyone],
                                            [{} for _ in everyone])
        for n, value in expect.items():
            diff = float(np.max(np.abs(host(got[n]).astype(np.float64) - value)))
            worst = max(worst, diff / max(1e-6, float(np.max(np.abs(value)))))
    assert worst < 1e-5, worst
    return {"rel_err": worst, "bytes_sent": stats["bytes_sent"],
            "collectives": stats["collectives"]}


def checkpoint_phase(spec, path, phase, total_steps=6, save_at=3, device="cpu"):
    """phase 'run': train total_steps, saving at save_at; phase 'resume': load and finish."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank = hvd.rank()
    device = use_device(device)
    torch.manual_seed(0)
    model = make_model(device)
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0),
                                  named_parameters=model.named_parameters(), compression=spec, min_numel=0)
    start = 0
    if phase == "resume":
        ckpt = torch.load(f"{path}.rank{rank}", weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = save_at
    for step in range(start, total_steps):
        if phase == "run" and step == save_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.rank{rank}")
        x, y = batch(rank, step, device=device)
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        opt.step()
    return {"params": {n: host(p).tobytes().hex() for n, p in model.named_parameters()}}


def checkpoint_phases(specs, path, phase, device="cpu"):
    """:func:`checkpoint_phase` for several compressors in one launch (one folder each)."""
    return {spec: checkpoint_phase(spec, f"{path}.{i}", phase, device=device)
            for i, spec in enumerate(specs)}


def horovod_own_optimizer(specs=("fp16", "bf16", "randomk:ratio=0.1", "powersgd:rank=2", "none"),
                          steps=2, device="cpu"):
    """Summable compressors through horovod.torch.DistributedOptimizer; top-k must refuse."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = use_device(device)
    report = {}
    for spec in specs:
        model = make_model(device)
        comp = hc.compressor(spec)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=comp)
        ref = Reference(str(comp.spec), size)
        worst = 0.0
        for step in range(steps):
            local, got, _ = exchange_step(opt, model, rank, step, device=device)
            everyone = hvd.allgather_object({k: host(v) for k, v in local.items()})
            expect = ref.step(everyone, [{} for _ in everyone])
            for name, value in expect.items():
                if name.startswith("unused"):
                    continue
                assert got[name].device == device, (spec, name, got[name].device)
                diff = float(np.max(np.abs(host(got[name]).astype(np.float64) - value)))
                tol = {"fp16": 2e-3, "bf16": 2 ** -7}.get(spec, 1e-4)
                worst = max(worst, diff / max(1e-6, float(np.max(np.abs(value)))))
                assert diff <= tol * max(1e-6, float(np.max(np.abs(value)))), (spec, name, diff)
        report[spec] = worst
    # a compressor whose payload cannot be summed refuses with a clear error
    model = make_model(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hc.TopK(ratio=0.1))
    x, y = batch(rank, 0, device=device)
    message = ""
    try:
        loss_fn(model, x, y).backward()
        opt.synchronize()
    except RuntimeError as exc:
        message = str(exc)
    return {"rank": rank, "report": report, "topk_error": message}


def state_survives_missing_grads(spec="topk:ratio=0.1", steps=6):
    """EF/DGC state with zero_grad(set_to_none=True) and a parameter that only sometimes
    gets a gradient: nothing sent is lost (sent + residual == sum of inputs)."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = make_model()
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                  named_parameters=model.named_parameters(), compression=spec, min_numel=0)
    core = opt.compression.core
    total_in = {n: np.zeros(p.numel()) for n, p in model.named_parameters()}
    total_out = {n: np.zeros(p.numel()) for n, p in model.named_parameters()}
    for step in range(steps):
        use_extra = step % 3 == 2
        x, y = batch(rank, step)
        local = _local_grads(model, x, y, use_extra)
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y, use_extra).backward()
        opt.synchronize()
        everyone_in = hvd.allgather_object({k: v.numpy().ravel() for k, v in local.items()})
        for n, p in model.named_parameters():
            total_in[n] += sum(e[n] for e in everyone_in)
            total_out[n] += p.grad.numpy().ravel() * size  # sum over ranks
        with opt.skip_synchronize():
            opt.step()
    residual_key = "v" if spec.startswith("dgc") else "residual"
    residuals = hvd.allgather_object({n: core.states[n][residual_key].numpy()
                                      for n, _ in model.named_parameters()})
    worst = 0.0
    for n in total_in:
        held = sum(r[n] for r in residuals)
        worst = max(worst, float(np.max(np.abs(total_out[n] + held - total_in[n]))))
    assert worst < 1e-4, worst
    steps_seen = {n: int(core.states[n]["step"]) for n, _ in model.named_parameters()}
    return {"worst": worst, "steps": steps_seen}


def _tensor_steps(sd):
    """Every per-tensor ``step`` counter in a compressor's (or policy's) state_dict."""
    if "compressors" in sd:
        return sorted(x for v in sd["compressors"].values() for x in _tensor_steps(v))
    return sorted(int(st["step"]) for st in sd.get("tensors", {}).values())


def resume_with_broadcast(path, specs=("none", "topk:ratio=0.1", "randomk:ratio=0.3",
                                       "powersgd:rank=1")):
    """Horovod's documented resume pattern with ours: train, rank 0 saves
    ``opt.state_dict()``; a new optimizer (Adam: its state is made lazily) on every
    rank, rank 0 loads the file with torch.load's defaults, then every rank calls
    broadcast_parameters and broadcast_optimizer_state -- which must return (it steps
    the ranks with empty state only) -- and training goes on with ranks in agreement:
    the state every rank must share (step counters keying Random-k's indices,
    PowerSGD's Q) is rank 0's after the first exchange."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank = hvd.rank()
    out = {}
    for spec in specs:
        model = make_model()
        opt = hc.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(),
                                      compression=spec, min_numel=0)
        for step in range(2):
            opt.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            opt.step()
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        hvd.allreduce(torch.zeros(1), name=f"saved.{spec}")  # a barrier
        model = make_model()
        opt = hc.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(),
                                      compression=spec, min_numel=0)
        if rank == 0:
            ckpt = torch.load(path)  # weights_only=True: tensors and plain values only
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        moments = [opt.state[p]["exp_avg"].flatten().tolist() for p in model.parameters()]
        for step in range(2, 4):
            opt.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            opt.step()
        out[spec] = {"moments": moments,
                     "params": [p.detach().flatten().tolist() for p in model.parameters()],
                     "steps": _tensor_steps(opt._compression.state_dict())}
    return out


def _optimizers():
    """Every optimizer class in torch.optim that Horovod's broadcast_optimizer_state
    takes (it refuses LBFGS), with arguments that give each one state."""
    kw = {"SGD": {"lr": 0.1, "momentum": 0.9}, "ASGD": {"lr": 0.1, "t0": 1.0},
          "Adafactor": {"lr": 0.01}, "Muon": {"lr": 0.01}}
    found = {}
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) \
                and cls is not torch.optim.Optimizer and name != "LBFGS":
            found[name] = (cls, kw.get(name, {"lr": 0.01}))
    return found


class _Embedder(torch.nn.Module):
    """For SparseAdam, which takes sparse gradients only."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 5, sparse=True)

    def forward(self, x, use_extra=False):
        return self.emb((x.flatten(1)[:, :6] * 4).long() % 20).sum(1)


class _Matrices(torch.nn.Module):
    """For Muon, which takes 2-D parameters only."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 12, bias=False)
        self.b = torch.nn.Linear(12, 5, bias=False)

    def forward(self, x, use_extra=False):
        return self.b(torch.relu(self.a(x.flatten(1))))


def _state_record(opt):
    """The optimizer's state and options as plain lists, in parameter order."""
    sd = opt.state_dict()
    state = []
    for group in sd["param_groups"]:
        for pid in group["params"]:
            entry = {}
            for key, v in sorted(sd["state"].get(pid, {}).items()):
                if torch.is_tensor(v):
                    v = v.to_dense() if v.is_sparse else v
                    entry[key] = [float(x) for x in v.detach().double().flatten().tolist()]
                else:
                    entry[key] = [float(v)]
            state.append(entry)
    options = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float))}
               for g in sd["param_groups"]]
    return {"state": state, "options": options}


def _flat_params(model):
    return [float(x) for p in model.parameters() for x in p.detach().double().flatten().tolist()]


def broadcast_every_optimizer(names=None, steps=1):
    """Horovod's resume pattern for every torch.optim optimizer, each in every
    combination of ranks with state (none, rank 0 only, all), wrapped by ours
    (compression none) and by Horovod's: rank 0's model and state are broadcast, the
    state each rank holds afterwards is recorded, whether the state-making step moved
    the parameters, then ``steps`` training steps."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank = hvd.rank()
    out = {}
    for name, (cls, kw) in sorted(_optimizers().items()):
        if names and name not in names:
            continue
        model_cls = {"SparseAdam": _Embedder, "Muon": _Matrices}.get(name, Net)
        for case in ("none", "root", "all"):
            for wrapper in ("ours", "horovod"):
                torch.manual_seed(100 + rank)  # ranks start apart: the broadcast matters
                model = model_cls()
                if model_cls is Net:  # every parameter gets a gradient: with one that never
                    model.unused.requires_grad_(False)  # does, ranks broadcast different
                    # state lists and Horovod's broadcast hangs -- with either optimizer
                if case == "all" or (case == "root" and rank == 0):
                    base = cls(model.parameters(), **kw)  # state from two local steps
                    for step in range(2):
                        base.zero_grad()
                        loss_fn(model, *batch(rank, 50 + step)).backward()
                        base.step()
                    saved = base.state_dict()
                    model.zero_grad(set_to_none=True)
                else:
                    saved = None
                if wrapper == "ours":
                    opt = hc.DistributedOptimizer(cls(model.parameters(), **kw),
                                                  named_parameters=model.named_parameters(),
                                                  compression="none")
                else:
                    opt = hvd.DistributedOptimizer(cls(model.parameters(), **kw),
                                                   named_parameters=model.named_parameters())
                if saved is not None:
                    opt.load_state_dict(saved)
                before = _state_record(opt)
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                given = _flat_params(model)
                hvd.broadcast_optimizer_state(opt, root_rank=0)
                after = _state_record(opt)
                moved = _flat_params(model) != given  # by the state-making step
                for step in range(steps):
                    opt.zero_grad()
                    loss_fn(model, *batch(rank, step)).backward()
                    opt.step()
                out[f"{name}:{case}:{wrapper}"] = {"before": before, "after": after,
                                                   "moved": moved, "params": _flat_params(model)}
    return out
