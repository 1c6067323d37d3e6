"""Bodies for tests/test_diloco.py (torch), one ``horovodrun -np 3`` launch.

The np 2 cases run on the process set of ranks 0 and 1 (rank 2 only waits at the
closing barrier), the np 3 cases on every rank.  The model: Linear(4, 3), Tanh,
Linear(3, 2) (tensors ``0.bias 0.weight 2.bias 2.weight`` in exchange order, 3, 12, 2
and 6 values), squared loss on data of each rank's own; the inner optimizer records
the parameters after each of its own steps, i.e. what each rank holds before a sync:
the inputs of the numpy reference (tests/workers/diloco_hand.py).
"""

from __future__ import annotations

import io

import numpy as np
import torch

_PAIR = []  # the process set of ranks 0 and 1, once Horovod is up
SEEN = []   # the parameters after each inner step: {name: list}


def init_with_pair():
    """Horovod up with the process set of ranks 0 and 1 (every body of the shared np 3
    launch, tests.launches.TORCH_GLOO3, starts Horovod through this): ``(hvd, the set)``."""
    import horovod.torch as hvd

    from . import started_with_pair
    return started_with_pair(hvd, _PAIR)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _batch(rank, step):
    g = np.random.default_rng(1000 + 97 * rank + step)
    x = g.normal(size=(8, 4)).astype(np.float32) * (1 + rank)
    y = np.stack([x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32),
                  x[:, 0] * (1.0 + rank)], 1).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)


def _named(model) -> dict:
    return {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}


def _recorder(base):
    """``base`` (an optimizer class) whose own step records the parameters by name."""
    class Recorder(base):
        def step(self, closure=None):
            loss = super().step(closure)
            names = {p: n for n, p in self._rec_model.named_parameters()}
            SEEN.append({names[p]: p.detach().reshape(-1).tolist()
                         for g in self.param_groups for p in g["params"]})
            return loss
    return Recorder


def _optimizer(model, spec, period, fragments, outer_lr, outer_momentum, warmup, pset,
               inner="sgd"):
    import hvd_compress.torch as hc
    if inner == "sgd":
        base = _recorder(torch.optim.SGD)(model.parameters(), lr=0.1, momentum=0.5)
    else:
        base = _recorder(torch.optim.AdamW)(model.parameters(), lr=0.01, weight_decay=0.1)
    opt = hc.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                  compression=spec, backward_passes_per_step=period,
                                  local_sgd=True, local_sgd_warmup_steps=warmup,
                                  outer_lr=outer_lr, outer_momentum=outer_momentum,
                                  fragments=fragments, min_numel=0, process_set=pset)
    opt._rec_model = model
    return opt


def _train(model, opt, rank, steps, log=None, start=0):
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        if log is not None:
            log.append({"inner": SEEN[-1], "after": _named(model),
                        "synced": opt._local.synced,
                        "bytes": opt.last_stats["bytes_sent"]})


def outer_run(spec="none", size=2, period=4, fragments=1, steps=8, outer_lr=0.7,
              outer_momentum=0.9, warmup=0):
    """DiLoCo for ``steps`` steps; per step every rank's parameters after its inner step
    and after the optimizer's step, the fragment syncs so far and the bytes sent; the
    first parameters and the fragments by name."""
    hvd, pair = init_with_pair()
    pset = pair if size == 2 else hvd.global_process_set
    out = None
    if hvd.rank() < size:
        model = _model()
        first = _named(model)
        opt = _optimizer(model, spec, period, fragments, outer_lr, outer_momentum, warmup, pset)
        SEEN.clear()
        log = []
        _train(model, opt, hvd.rank(), steps, log)
        names = opt._parameter_names
        out = {"first": first, "log": log,
               "fragments": [[names[p] for p in run] for run in opt._local.fragments]}
    hvd.barrier()
    return out


def resume(spec="topk:ratio=0.25", size=3, period=4, fragments=2, steps=11, cut=7):
    """The same DiLoCo run (AdamW inside) uninterrupted and saved after ``cut`` steps
    (between two syncs), loaded into a fresh model and optimizer, continued to ``steps``:
    both runs' parameters at the end, and what the checkpoint held."""
    hvd, pair = init_with_pair()
    pset = pair if size == 2 else hvd.global_process_set
    out = None
    if hvd.rank() < size:
        rank = hvd.rank()
        model = _model()
        opt = _optimizer(model, spec, period, fragments, 0.7, 0.9, 0, pset, inner="adamw")
        _train(model, opt, rank, steps)
        whole = _named(model)

        model = _model()
        opt = _optimizer(model, spec, period, fragments, 0.7, 0.9, 0, pset, inner="adamw")
        _train(model, opt, rank, cut)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        saved = opt.state_dict()["hvd_compress"]
        del model, opt
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=False)
        model = _model()
        for p in model.parameters():  # a fresh model elsewhere: nothing left of the first
            torch.nn.init.normal_(p)
        opt = _optimizer(model, spec, period, fragments, 0.7, 0.9, 0, pset, inner="adamw")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        _train(model, opt, rank, steps - cut, start=cut)
        out = {"whole": whole, "resumed": _named(model), "synced": saved["outer"]["synced"],
               "momenta": sorted(saved["outer"]["momenta"]), "anchors": sorted(saved["anchors"])}
    hvd.barrier()
    return out


def torchft_diloco(opt, theirs, inner, period, average=None, participants=1):
    """torchft's ``DiLoCo`` over ``theirs`` (the model ``opt``, our optimizer, steps, made
    alike) with ``inner``: its fragments modules holding the parameters of our fragments,
    each with its own outer Nesterov SGD (torchft's list form: a single one over the whole
    model would also step the other fragments' parameters on their inner gradients); its
    manager a stand-in whose allreduce is ``average(t)`` in place (None: one replica, left
    as it is) and whose step counter moves at each commit, as torchft's manager's does.
    Returns ``(the DiLoCo context, [commits so far])``; ImportError without torchft."""
    from unittest.mock import create_autospec

    from torchft import local_sgd
    from torchft.manager import Manager
    from torchft.work import _DummyWork
    names = opt._parameter_names
    by_name = dict(theirs.named_parameters())
    parts = []
    for run in opt._local.fragments:
        part = torch.nn.Module()
        for i, p in enumerate(run):
            part.register_parameter(f"p{i}", by_name[names[p]])
        parts.append(part)
    manager = create_autospec(Manager)
    manager._use_async_quorum = False
    manager._rank0_synchronization_only = False
    manager.errored.return_value = None
    manager.num_participants.return_value = participants

    def allreduce(t, should_quantize=False):
        if average is not None:
            average(t)
        return _DummyWork(t)
    manager.allreduce.side_effect = allreduce
    commits = [0]
    manager.current_step.side_effect = lambda: commits[0]

    def commit():
        commits[0] += 1
        return True
    manager.should_commit.side_effect = commit
    outer = [torch.optim.SGD(part.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for part in parts]
    return local_sgd.DiLoCo(manager, parts, inner, outer, sync_every=period), commits


def torchft_run(period=4, fragments=2, steps=12):
    """Every rank of the np 3 launch: our DiLoCo (``none``, AdamW inside) and torchft's
    ``DiLoCo`` (:func:`torchft_diloco`) on the same model and each rank's own data, the
    stand-in manager's allreduce Horovod's average over the ranks (what torchft's own
    manager returns: the sum over the replicas divided by their number).  Per step both
    models' parameters; None where torchft is not installed."""
    hvd, _ = init_with_pair()
    import hvd_compress.torch as hc
    rank = hvd.rank()
    ours = _model()
    opt = hc.DistributedOptimizer(torch.optim.AdamW(ours.parameters(), lr=0.01,
                                                    weight_decay=0.1),
                                  named_parameters=ours.named_parameters(),
                                  backward_passes_per_step=period, local_sgd=True,
                                  outer_lr=0.7, outer_momentum=0.9, fragments=fragments,
                                  min_numel=0)
    theirs = _model()
    inner = torch.optim.AdamW(theirs.parameters(), lr=0.01, weight_decay=0.1)
    calls = [0]

    def average(t):  # named: the launch's earlier bodies ran unnamed collectives on some
        calls[0] += 1  # ranks only
        hvd.allreduce_(t, op=hvd.Average, name=f"torchft.{calls[0]}")
    try:
        diloco, commits = torchft_diloco(opt, theirs, inner, period, average, hvd.size())
    except ImportError:
        hvd.barrier()
        return None
    log = []
    with diloco:
        for step in range(steps):
            for model, o in ((ours, opt), (theirs, inner)):
                x, y = _batch(rank, step)
                o.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                o.step()
            log.append({"ours": _named(ours), "theirs": _named(theirs)})
    out = {"log": log, "commits": commits[0], "synced": opt._local.synced}
    hvd.barrier()
    return out
