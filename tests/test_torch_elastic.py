"""Horovod's elastic PyTorch pattern with our optimizer, next to Horovod's own.

One elastic ``horovodrun`` (Gloo, ``-np 2 --min-np 1 --max-np 2``, hosts from a
discovery script the workers rewrite) trains Horovod's optimizer and ours with
``none``, top-k, random-k and PowerSGD side by side in one ``hvd.elastic.TorchState``
through a rollback (``HorovodInternalError``), a worker leaving (2 -> 1) and one
joining (1 -> 2); see tests/workers/torch_elastic.py.  The rule checked is the one in
:mod:`hvd_compress.torch.elastic`: shared compressor state from rank 0, per-rank state
kept by survivors and zero on a new worker.
"""

import math

import numpy as np
import pytest
import torch

from hvd_compress.core import registry
from tests.harness import run_horovod_elastic
from tests.workers.torch_elastic import SPECS

pytestmark = pytest.mark.multiprocess

STEPS, COMMIT_EVERY, FAIL_AT, SHRINK_AT, GROW_AT = 13, 3, 5, 7, 10
OURS = [f"{kind}:{spec}" for kind, spec in SPECS if kind == "ours"]


@pytest.fixture(scope="module")
def story():
    runs = run_horovod_elastic(
        "tests.workers.torch_elastic:train_through_changes", hosts="localhost:1\n127.0.0.1:1",
        np=2, min_np=1, max_np=2, timeout=300,
        kwargs={"steps": STEPS, "commit_every": COMMIT_EVERY, "fail_at": FAIL_AT,
                "shrink_at": SHRINK_AT, "grow_at": GROW_AT})
    # the worker that left ends inside Horovod (see the worker's docstring): two report
    assert len(runs) == 2, [(r["host"], r["syncs"]) for r in runs]
    survivor = next(r for r in runs if r["syncs"][0]["batch"] == 0)
    joiner = next(r for r in runs if r is not survivor)
    return {"survivor": survivor, "joiner": joiner}


def _by_batch(log, batch):
    return [e for e in log if e["batch"] == batch]


def test_the_world_changed_as_planned(story):
    s, j = story["survivor"], story["joiner"]
    replay = list(range(COMMIT_EVERY, FAIL_AT))  # trained, rolled back, trained again
    assert [e["batch"] for e in s["log"]] == \
        list(range(FAIL_AT)) + replay + list(range(FAIL_AT, STEPS))
    for e in s["log"]:
        assert e["rank"] == 0
        assert e["size"] == (1 if SHRINK_AT <= e["batch"] < GROW_AT else 2), e["batch"]
    assert [(e["batch"], e["rank"], e["size"]) for e in j["log"]] == \
        [(b, 1, 2) for b in range(GROW_AT, STEPS)]
    # the training function was entered at the start, after the rollback, after the
    # leave (no sync: Horovod skips it when workers only left) and after the join
    assert [(x["batch"], x["size"]) for x in s["syncs"]] == \
        [(0, 2), (COMMIT_EVERY, 2), (SHRINK_AT, 1), (GROW_AT, 2)]
    assert [(x["batch"], x["rank"], x["size"]) for x in j["syncs"]] == [(GROW_AT, 1, 2)]


def test_none_is_horovods_throughout(story):
    for run in (story["survivor"], story["joiner"]):
        for e in run["log"]:
            for a, b in zip(e["params"]["ours:none"], e["params"]["horovod:None"]):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=str(e["batch"]))


def test_rollback_restores_parameters_and_compressor_state(story):
    """The batches after the last commit, trained again after the rollback, give the same
    parameters bit for bit: the residuals and counters were rolled back with the model."""
    s = story["survivor"]
    for batch in range(COMMIT_EVERY, FAIL_AT):
        first, again = _by_batch(s["log"], batch)
        assert first["params"] == again["params"], batch
    committed = next(c for c in s["commits"] if c["batch"] == COMMIT_EVERY)
    assert s["syncs"][1]["state"] == committed["state"]
    assert any(t["own"] > 0 for t in committed["state"]["ours:topk:ratio=0.3"].values())


def test_compressors_follow_the_world(story):
    for run in (story["survivor"], story["joiner"]):
        for e in run["log"]:
            for tag in OURS:
                assert e["bound"][tag] == [e["rank"], e["size"]], (e["batch"], tag)


def test_ranks_agree_after_the_join(story):
    s, j = story["survivor"], story["joiner"]
    for batch in range(GROW_AT, STEPS):
        (a,), (b,) = _by_batch(s["log"], batch), _by_batch(j["log"], batch)
        assert a["params"] == b["params"], batch  # random-k: the same indices on both
        assert all(v is not None and math.isfinite(v) for v in a["loss"].values())
    for tag in OURS:
        mine, theirs = s["syncs"][-1]["state"][tag], j["syncs"][-1]["state"][tag]
        assert mine.keys() == theirs.keys()
        for name in mine:  # shared state from rank 0; the new worker's own state is zero
            assert (mine[name]["step"], mine[name]["q"]) == \
                (theirs[name]["step"], theirs[name]["q"]), (tag, name)
            assert theirs[name]["own"] == 0.0
        assert all(st["step"] == GROW_AT for st in mine.values()), tag
    steps_at_end = {tag: {n: (st["step"], st["q"]) for n, st in s["final"][tag].items()}
                    for tag in OURS}
    assert steps_at_end == {tag: {n: (st["step"], st["q"]) for n, st in j["final"][tag].items()}
                            for tag in OURS}


def test_survivors_keep_their_own_state(story):
    """After the leave (no sync) and the join (sync from rank 0) the survivor's residuals
    are those it committed."""
    s = story["survivor"]
    for batch, sync in ((SHRINK_AT, s["syncs"][2]), (GROW_AT, s["syncs"][3])):
        committed = next(c for c in s["commits"] if c["batch"] == batch)
        assert sync["state"] == committed["state"], batch
        assert any(t["own"] > 0 for t in sync["state"]["ours:topk:ratio=0.3"].values())


# -- the split of compressor state (no launch) ----------------------------------------------

def _states(spec):
    import hvd_compress.torch as hc
    comp = hc.compressor(spec).bind(0, 2)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    core = comp.core
    enc = core.encode(x, "w")
    if core.rounds(enc.meta) == 2:
        enc = core.next_round(enc, enc.payload)
        core.aggregate(enc.payload, enc)
    return comp


@pytest.mark.parametrize("name", [a.name for a in registry.algorithms()]
                         + ["topk:ratio=0.3+qsgd"])
def test_every_state_key_is_classified(name):
    """A compressor's per-tensor state is either per-rank (PER_RANK) or shared (step, numel,
    PowerSGD's q); a new key must be placed on one side (hvd_compress.torch.elastic)."""
    from hvd_compress.torch.elastic import PER_RANK
    sd = _states(name).state_dict()
    for st in sd["tensors"].values():
        assert set(st) <= PER_RANK | {"numel", "step", "q"}, (name, set(st))
    assert set(sd.get("extra", {})) <= {"noise"}


def test_shared_and_merged_state():
    from hvd_compress.torch.elastic import merge_state, shared_state
    comp = _states("powersgd:rank=1")
    mine = comp.state_dict()
    shared = shared_state(mine)
    joined = merge_state(shared, {})  # a new worker: shared parts, zero residual
    st, new = mine["tensors"]["w"], joined["tensors"]["w"]
    assert new["step"] == st["step"] == 1 and torch.equal(new["q"], st["q"])
    assert torch.count_nonzero(new["residual"]) == 0 and new["residual"].shape == \
        st["residual"].shape
    kept = merge_state(shared, mine)["tensors"]["w"]  # a survivor keeps its own
    assert torch.equal(kept["residual"], st["residual"])
    assert torch.count_nonzero(st["residual"]) > 0


def test_torch_state_picks_our_handler_for_ours_only():
    import horovod.torch as hvd
    from horovod.torch.elastic import state as hvd_state

    import hvd_compress.torch as hc
    from hvd_compress.torch.elastic import OptimizerStateHandler
    hvd.init()
    m = torch.nn.Linear(4, 3)

    def ours(**kw):
        return hc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters(),
                                       compression="topk:ratio=0.5", **kw)
    state = hvd.elastic.TorchState(model=m, optimizer=ours(),
                                   plain=torch.optim.SGD(m.parameters(), lr=0.1))
    assert type(state._handlers["optimizer"]) is OptimizerStateHandler
    assert type(state._handlers["plain"]) is hvd_state.OptimizerStateHandler
    state.sync()  # one rank: Horovod's broadcasts and ours run through
    local = hvd.elastic.TorchState(optimizer=ours(local_sgd=True, backward_passes_per_step=2))
    with pytest.raises(NotImplementedError, match="local_sgd"):
        local.sync()
