"""Bodies for tests/test_torch_elastic.py: Horovod's elastic PyTorch pattern
(``hvd.elastic.TorchState``, ``@hvd.elastic.run``, ``state.commit()``) with our optimizer
next to Horovod's own, under an elastic ``horovodrun`` (tests.harness.run_horovod_elastic).

One run trains several (model, optimizer) pairs side by side in one ``TorchState``, on
the same batches, through three elastic events:

* at batch ``fail_at`` every rank raises ``HorovodInternalError`` (as a collective that
  failed would): the state rolls back to the last commit and the batches since are
  trained again;
* after batch ``shrink_at - 1`` rank 0 removes the other host from discovery and, once
  Horovod has told it, commits: ``HostsUpdatedInterrupt``, the other worker leaves and
  rank 0 goes on alone (Horovod skips the sync when workers only left).  Horovod 0.28.1
  ends the removed process in its re-initialisation (an uncaught C++ exception, exit
  status 134, which the elastic driver ignores): it reports nothing;
* after batch ``grow_at - 1`` rank 0 gives its own host a second slot: a new worker
  process starts, both sync from rank 0 and train on to ``steps``.
"""

from __future__ import annotations

import math
import os
import threading

import torch

from tests.workers.torch_patterns import _batch, _model  # the same model and batches

SPECS = (("horovod", None), ("ours", "none"), ("ours", "topk:ratio=0.3"),
         ("ours", "randomk:ratio=0.3"), ("ours", "powersgd:rank=1"))


def _optimizer(kind, model, spec, prefix):
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    named = [(f"{prefix}.{n}", p) for n, p in model.named_parameters()]
    if kind == "horovod":
        return hvd.DistributedOptimizer(base, named_parameters=named)
    return hc.DistributedOptimizer(base, named_parameters=named, compression=spec, min_numel=0)


def _params(model):
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _compressor_state(opt) -> dict:
    """Per tensor: the shared state (step; PowerSGD's Q, as a list) and the sum of the
    magnitudes of this rank's own state (residuals)."""
    from hvd_compress.torch.elastic import PER_RANK
    out = {}
    for name, st in opt.state_dict()["hvd_compress"]["compressor"].get("tensors", {}).items():
        out[name] = {"step": int(st["step"]),
                     "q": st["q"].flatten().tolist() if "q" in st else None,
                     "own": float(sum(st[k].abs().sum() for k in PER_RANK if k in st))}
    return out


class _Notices:
    """Horovod's notice to rank 0 that the hosts changed (a listener of its own)."""

    def __init__(self):
        self.event = threading.Event()

    def on_hosts_updated(self, timestamp, update_res):
        self.event.set()


def _change_hosts(hosts: str, notices: _Notices, wait_s: float) -> None:
    from tests.harness import set_hosts
    notices.event.clear()
    set_hosts(hosts)
    if not notices.event.wait(wait_s):
        raise TimeoutError(f"Horovod did not notice the hosts {hosts!r} in {wait_s}s")


def train_through_changes(steps=13, commit_every=3, fail_at=5, shrink_at=7, grow_at=10,
                          wait_s=60.0):
    """Returns this worker's story: ``log`` (one entry per batch trained, replays
    included: rank, size, every pair's parameters and loss, our compressors' bound rank and
    size), ``syncs`` (at each entry into the training function: batch, rank, size, our
    compressors' state), ``commits`` (the same state at each commit) and ``final`` (that
state at the end)."""
    import horovod.torch as hvd
    from horovod.common.elastic import notification_manager
    from horovod.common.exceptions import HorovodInternalError

    hvd.init()
    me = os.environ["HOROVOD_HOSTNAME"]
    pairs, objects = [], {}
    for i, (kind, spec) in enumerate(SPECS):
        model = _model()
        opt = _optimizer(kind, model, spec, f"m{i}")
        pairs.append((f"{kind}:{spec}", model, opt))
        objects[f"model{i}"], objects[f"opt{i}"] = model, opt
    state = hvd.elastic.TorchState(batch=0, **objects)
    notices = _Notices()
    notification_manager.register_listener(notices)
    story = {"host": me, "log": [], "syncs": [], "commits": []}
    failed = []

    def ours():
        return [(tag, opt) for tag, _, opt in pairs if tag.startswith("ours")]

    @hvd.elastic.run
    def train(state):
        story["syncs"].append({"batch": state.batch, "rank": hvd.rank(), "size": hvd.size(),
                               "state": {t: _compressor_state(o) for t, o in ours()}})
        while state.batch < steps:
            b = state.batch
            if b == fail_at and not failed:
                failed.append(b)
                raise HorovodInternalError("simulated: a collective failed")
            entry = {"batch": b, "rank": hvd.rank(), "size": hvd.size(), "params": {},
                     "loss": {}, "bound": {}}
            for tag, model, opt in pairs:
                x, y = _batch(hvd.rank(), b)
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                entry["params"][tag] = _params(model)
                entry["loss"][tag] = loss.item() if math.isfinite(loss.item()) else None
            for tag, opt in ours():
                entry["bound"][tag] = [opt.compression._rank, opt.compression._world_size]
            story["log"].append(entry)
            state.batch = b + 1
            change = None
            if hvd.rank() == 0 and state.batch == shrink_at and hvd.size() == 2:
                change = f"{me}:1"
            elif hvd.rank() == 0 and state.batch == grow_at and hvd.size() == 1:
                change = f"{me}:2"
            if change:
                _change_hosts(change, notices, wait_s)
            if state.batch % commit_every == 0 or state.batch in (shrink_at, grow_at):
                story["commits"].append({"batch": state.batch, "size": hvd.size(), "state": {
                    t: _compressor_state(o) for t, o in ours()}})
                state.commit()

    train(state)
    story["final"] = {t: _compressor_state(o) for t, o in ours()}
    return story
