"""Bodies for tests/test_torch_patterns.py: Horovod's documented usage patterns with our
optimizer next to Horovod's own, under horovodrun -np 2."""

from __future__ import annotations

import torch


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g) * (3.0 if step % 2 else 1.0), \
        torch.randint(0, 3, (6,), generator=g)


def _wrap(kind, model, spec, **kwargs):
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    if kind == "horovod":
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kwargs)
    return hc.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=spec, **kwargs, min_numel=0)


def _params(model):
    return [p.detach().flatten().tolist() for p in model.parameters()]


def clipping(steps=4, max_norm=0.2):
    """Horovod's clipping pattern: synchronize(), clip the averaged gradients, step inside
    skip_synchronize().  Per (optimizer, spec): the parameters after every step."""
    import horovod.torch as hvd
    hvd.init()
    out = {}
    for kind, spec in (("horovod", None), ("ours", "none"), ("ours", "topk:ratio=0.3")):
        model = _model()
        opt = _wrap(kind, model, spec)
        log = []
        for step in range(steps):
            x, y = _batch(hvd.rank(), step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.synchronize()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with opt.skip_synchronize():
                opt.step()
            log.append({"params": _params(model), "norm": float(norm)})
        out[f"{kind}:{spec}"] = log
    return out


def join_uneven(spec="none"):
    """Uneven data with hvd.join(): rank 1 has one batch fewer; the ranks that run out call
    join() and the others' last exchange completes.  Returns the parameters and join's
    result (the last rank to join); for ours also the parameters before the first step
    and, per step, the local gradients (computed apart) and the averaged ones the
    optimizer left, by parameter name."""
    import horovod.torch as hvd
    hvd.init()
    out = {}
    for kind in ("horovod", "ours"):
        if kind == "horovod" and spec != "none":
            continue
        model = _model()
        opt = _wrap(kind, model, spec)
        first, steps = _params(model), []
        for step in range(3 - hvd.rank()):
            x, y = _batch(hvd.rank(), step)
            opt.zero_grad()
            named = list(model.named_parameters())
            local = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y),
                                        [p for _, p in named])
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps.append({"local": {n: g.flatten().tolist() for (n, _), g in zip(named, local)},
                          "got": {n: p.grad.flatten().tolist() for n, p in named}})
        last = hvd.join()
        out[kind] = {"params": _params(model), "last": int(last), "first": first,
                     "steps": steps}
    return out


def ops():
    """op= as Horovod's: Sum and Min with none give Horovod's results; Min with a
    compressor and Adasum are refused with ValueError (the message returned)."""
    import horovod.torch as hvd
    hvd.init()
    out = {}
    for op_name in ("Sum", "Min"):
        op = getattr(hvd, op_name)
        for kind in ("horovod", "ours"):
            model = _model()
            opt = _wrap(kind, model, "none", op=op)
            x, y = _batch(hvd.rank(), 1)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            out[f"{kind}:{op_name}"] = _params(model)
    for op_name, spec in (("Min", "topk:ratio=0.3"), ("Adasum", "none")):
        try:
            _wrap("ours", _model(), spec, op=getattr(hvd, op_name))
            out[f"refused:{op_name}"] = None
        except ValueError as exc:
            out[f"refused:{op_name}"] = str(exc)
    return out


def process_set(steps=3):
    """np 3, a process set of ranks 0 and 1: they train with the set's averages (Horovod's
    optimizer and ours with none and top-k); rank 2 trains alone, outside it.  Horovod is
    started by :func:`.diloco.init_with_pair` (under Gloo this body runs in the shared np 3
    launch, tests.launches.TORCH_GLOO3)."""
    from .diloco import init_with_pair
    hvd, pair = init_with_pair()
    out = {}
    for kind, spec in (("horovod", None), ("ours", "none"), ("ours", "topk:ratio=0.3")):
        model = _model()
        opt = _wrap(kind, model, spec, process_set=pair)
        for step in range(steps):
            x, y = _batch(hvd.rank(), step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[f"{kind}:{spec}"] = _params(model)
    hvd.barrier()  # rank 2 must not shut Horovod down while the pair still exchanges
    return out


def predivide(factor=3.0, spec="threshold:tau=0.05", steps=2):
    """``gradient_predivide_factor``: Horovod's optimizer and ours with none at ``factor``
    and at 1 (the parameters after ``steps`` steps); ours with ``spec`` (a compressor
    whose output does not scale with its input) at ``factor`` and at 1: per step the
    local gradients and the averaged ones; and the refusals of a factor with op=Sum."""
    import horovod.torch as hvd
    hvd.init()
    out = {}
    for kind, spec_, f in (("horovod", None, factor), ("horovod", None, 1.0),
                           ("ours", "none", factor), ("ours", spec, factor), ("ours", spec, 1.0)):
        model = _model()
        opt = _wrap(kind, model, spec_, gradient_predivide_factor=f)
        log = []
        for step in range(steps):
            x, y = _batch(hvd.rank(), step)
            opt.zero_grad()
            named = list(model.named_parameters())
            local = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y),
                                        [p for _, p in named])
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            log.append({"local": {n: g.flatten().tolist() for (n, _), g in zip(named, local)},
                        "got": {n: p.grad.flatten().tolist() for n, p in named}})
        out[f"{kind}:{spec_}:{f}"] = {"params": _params(model), "steps": log}
    for kind, spec_ in (("horovod", None), ("ours", "none"), ("ours", spec)):
        try:
            _wrap(kind, _model(), spec_, op=hvd.Sum, gradient_predivide_factor=factor)
            out[f"refused:{kind}:{spec_}"] = None
        except ValueError as exc:
            out[f"refused:{kind}:{spec_}"] = str(exc)
    return out
