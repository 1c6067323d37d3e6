"""1-bit Adam and 0/1 Adam (hvd_compress.core.adam, hvd_compress.torch.adam): the schedules,
the update against torch's Adam/AdamW and against the numpy reference (one worker, and
under horovodrun at 2 and 3 workers, bit for bit), nothing lost in the residuals, resume
bit for bit, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_compress.core import adam as rule
from hvd_compress.core import build
from hvd_compress.core.backend import NumpyBackend
from hvd_compress.core.twophase import chunk_bounds, chunk_name, owner_of, reference
from tests.launches import TORCH_GLOO, TORCH_GLOO3

B = NumpyBackend()
ONEBIT = {"freeze_step": 3}
ZEROONE = {"var_freeze_step": 10, "var_update_scaler": 2, "local_step_scaler": 3,
           "local_step_clipper": 4}
#: (key, algorithm, spec, schedule, steps, bias_correction, resume_at)
CASES = [("onebit-ef", "onebit", "efsignsgd", ONEBIT, 8, True, 5),
         ("onebit-seide-nobc", "onebit", "onebit", ONEBIT, 6, False, None),
         ("zeroone-ef", "zeroone", "efsignsgd", ZEROONE, 20, True, 13)]
for _launch, _cases in ((TORCH_GLOO, CASES), (TORCH_GLOO3, [CASES[0], CASES[2]])):
    for _key, _alg, _spec, _sched, _steps, _bc, _at in _cases:
        _launch.add(__name__, _key, "tests.workers.adam:matches_reference",
                    dict(algorithm=_alg, spec=_spec, sched=_sched, steps=_steps,
                         bias_correction=_bc, resume_at=_at))


# -- the schedules --------------------------------------------------------------------------
def test_zeroone_schedule_doubles_the_variance_interval_then_the_sync_interval():
    s = rule.ZeroOneSchedule(var_freeze_step=12, var_update_scaler=2, local_step_scaler=3,
                             local_step_clipper=4)
    kinds, syncs = [], []
    for t in range(1, 30):
        kinds.append(s.kind(t)[0])
        if s.kind(t) == "local" and s.syncs(t):
            syncs.append(t)
        s.advance(t)
    # variance at 1, 2 (interval 1), 4, 6 (interval 2), 8, 12 (interval 4); local from 13
    assert "".join(kinds[:12]) == "vvcvcvcvcccv"
    assert set(kinds[12:]) == {"l"}
    # sync spacing 1 for three local steps, then 2, then 4 (the clipper)
    assert syncs == [13, 14, 15, 16, 18, 20, 24, 28]
    assert s.var_updates == 6
    # where it stands depends on the step count only: a fresh one sought there agrees
    other = rule.ZeroOneSchedule(var_freeze_step=12, var_update_scaler=2, local_step_scaler=3,
                                 local_step_clipper=4)
    other.seek(29)
    assert other.state_dict() == s.state_dict()
    other.seek(5)
    assert other.state_dict()["var_interval"] == 2 and other.var_updates == 3


def test_onebit_schedule_and_bad_settings():
    s = rule.OneBitSchedule(3)
    assert [s.dense(t) for t in range(1, 6)] == [True, True, True, False, False]
    assert [s.variance_updates(t) for t in (1, 3, 9)] == [1, 3, 3]
    with pytest.raises(ValueError, match="freeze_step"):
        rule.OneBitSchedule(-1)
    with pytest.raises(ValueError, match="var_update_scaler"):
        rule.ZeroOneSchedule(5, var_update_scaler=0)


# -- one worker: torch's Adam / AdamW as oracles, the reference bit for bit ----------------------
def _grads_for(shapes, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(steps)]


def test_one_worker_is_adam_and_adamw_before_the_freeze():
    torch = pytest.importorskip("torch")
    import hvd_compress.torch as hc
    shapes, steps = [(6, 4), (5,)], 25
    grads = _grads_for(shapes, steps)
    for wd, oracle in ((0.0, torch.optim.Adam), (0.1, torch.optim.AdamW)):
        ours = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
        theirs = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
        for opt_ours in (hc.OneBitAdam(ours, lr=0.01, weight_decay=wd, freeze_step=10**6),):
            opt_theirs = oracle(theirs, lr=0.01, weight_decay=wd)
            for g in grads:
                for p, q, x in zip(ours, theirs, g):
                    p.grad, q.grad = torch.from_numpy(x.copy()), torch.from_numpy(x.copy())
                opt_ours.step()
                opt_theirs.step()
            for p, q in zip(ours, theirs):
                assert torch.allclose(p, q, rtol=0, atol=2e-6), (oracle, (p - q).abs().max())
                assert not torch.equal(p, torch.ones_like(p))


@pytest.mark.parametrize("algorithm", ["onebit", "zeroone"])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_one_worker_is_the_reference_bit_for_bit(algorithm, bias_correction):
    torch = pytest.importorskip("torch")
    import hvd_compress.torch as hc
    shapes, steps = [(6, 4), (5,)], 30
    grads = _grads_for(shapes, steps, seed=3)
    start = [np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for s in shapes]
    sched = dict(ONEBIT) if algorithm == "onebit" else dict(ZEROONE)
    h = rule.AdamHyper(lr=0.01, weight_decay=0.1, bias_correction=bias_correction)
    schedule = rule.OneBitSchedule(**sched) if algorithm == "onebit" else \
        rule.ZeroOneSchedule(**sched)
    ref = rule.reference(B, algorithm, schedule, h, start,
                         lambda t, r, ps: grads[t - 1] if t <= steps else None,
                         workers=[build("none")])
    ps = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in start]
    cls = hc.OneBitAdam if algorithm == "onebit" else hc.ZeroOneAdam
    opt = cls(ps, lr=0.01, weight_decay=0.1, bias_correction=bias_correction, **sched)
    for t, g in enumerate(grads):
        for p, x in zip(ps, g):
            p.grad = torch.from_numpy(x.copy())
        opt.step()
        for p, want in zip(ps, ref[t][0]):
            assert np.array_equal(p.detach().numpy(), want), (algorithm, t + 1)


# -- nothing lost ------------------------------------------------------------------------------
def _residual_total(workers, name, n):
    """Every worker's and owner's residual of tensor ``name`` (n values), summed in place."""
    p = len(workers)
    total = np.zeros(n, np.float64)
    for w in workers:
        for owner_too in (w, owner_of(w)):
            for j, (a, b) in enumerate(chunk_bounds(n, p)):
                st = owner_too.states.get(chunk_name(name, j, p))
                if st is not None and st.residual is not None:
                    total[a:b] += np.asarray(st.residual, np.float64).reshape(-1)
    return total


@pytest.mark.parametrize("spec", ["efsignsgd", "onebit"])
def test_compressed_momentum_loses_nothing_in_the_residuals(spec):
    """Over rounds of 1-bit Adam's compressed phase at 3 workers: what the workers sent plus
    the residuals before equals p times what every rank applied plus the residuals after."""
    p, n, name = 3, 37, "m"
    workers = [build(spec, rank=r, world_size=p) for r in range(p)]
    rng = np.random.default_rng(5)
    for _ in range(6):
        ms = [[rng.standard_normal(n).astype(np.float32)] for _ in range(p)]
        before = _residual_total(workers, name, n)
        (avg,) = reference(workers, ms, [name])
        after = _residual_total(workers, name, n)
        sent = np.sum([np.asarray(m[0], np.float64) for m in ms], axis=0)
        np.testing.assert_allclose(sent + before, p * np.asarray(avg, np.float64) + after,
                                   rtol=0, atol=1e-5)
        assert np.abs(after).max() > 0  # the compression did drop something, and it was kept


# -- under horovodrun: bit for bit against the reference, ranks agree, resume ----------------------
@pytest.fixture(scope="module")
def runs(request):
    return request


@pytest.mark.multiprocess
@pytest.mark.parametrize("launch, key", [(TORCH_GLOO, c[0]) for c in CASES] +
                         [(TORCH_GLOO3, CASES[0][0]), (TORCH_GLOO3, CASES[2][0])],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_wrapped_optimizer_is_the_reference_bit_for_bit(runs, launch, key):
    results = launch.results(runs, key)
    case = next(c for c in CASES if c[0] == key)
    steps, resume_at = case[4], case[6]
    assert len(results) == launch.launch_kwargs["np"]
    for r in results:
        assert r["same"] == [True] * steps, (key, r["same"], r["max_diff"])
        if case[1] == "onebit":
            assert all(r["ranks_agree_ref"] if "ranks_agree_ref" in r else r["ranks_agree"])
            dense = [w for w, _, _ in r["wire"][:case[3]["freeze_step"]]]
            compressed = [w for w, _, _ in r["wire"][case[3]["freeze_step"]:]]
            assert max(compressed) < min(dense) / 2, (dense, compressed)
        else:  # 0/1 Adam: local steps between syncs send nothing
            assert any(c == 0 for _, _, c in r["wire"][10:]), r["wire"]
            assert not all(r["ranks_agree"][10:])  # local steps drift apart, syncs rejoin
        if resume_at is not None:
            assert r["resumed_same"], key
    # every rank applied the same parameters where the reference says they agree
    for i, agree in enumerate(results[0]["ranks_agree"]):
        if agree:
            assert all(r["got"][i] == results[0]["got"][i] for r in results), (key, i)


# -- refusals ----------------------------------------------------------------------------------
def test_refusals():
    torch = pytest.importorskip("torch")
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    model = torch.nn.Linear(4, 3)
    for kwargs, match in (({"local_sgd": True}, "own local steps"),
                          ({"delay": 1}, "own local steps"),
                          ({"backward_passes_per_step": 2}, "backward_passes_per_step"),
                          ({"op": hvd.Sum}, "op must be Average")):
        with pytest.raises(ValueError, match=match):
            hc.DistributedOptimizer(hc.OneBitAdam(model.parameters()),
                                    named_parameters=model.named_parameters(), **kwargs)
    with pytest.raises(ValueError, match="Invalid beta"):
        hc.ZeroOneAdam(model.parameters(), betas=(0.9, 1.0))
    one = hc.OneBitAdam(model.parameters())
    with pytest.raises(ValueError, match="checkpoint is of 'onebit-adam'"):
        hc.ZeroOneAdam(model.parameters()).load_state_dict(one.state_dict())


def test_elastic_merge_keeps_this_ranks_owner_residuals():
    """The two-phase owner's residuals are this rank's chunks: a sync from the root (first
    exchange after a load, elastic reset) keeps them (it took the root's before)."""
    pytest.importorskip("torch")
    from hvd_compress.torch.elastic import merge_state, shared_state
    root = {"spec": {}, "tensors": {}, "owner": {"spec": {}, "tensors": {"w#0/2": {"x": 0}}}}
    mine = {"spec": {}, "tensors": {}, "owner": {"spec": {}, "tensors": {"w#1/2": {"x": 1}}}}
    assert "owner" not in shared_state(root)
    assert merge_state(shared_state(root), mine)["owner"] == mine["owner"]


@pytest.mark.parametrize("min_numel", [0, 4])
def test_restarting_error_feedback_empties_every_residual(min_numel):
    """0/1 Adam's local steps start from zero residuals, with one compressor or a per-tensor
    policy (the examples' default): gradient residuals added to accumulated updates, 300
    times smaller, made the loss explode."""
    torch = pytest.importorskip("torch")
    from hvd_compress.core.spec import parse
    from hvd_compress.torch.compressors import as_compression, emptied_state
    comp = as_compression("efsignsgd", min_numel, 0)
    child = comp.child(parse("efsignsgd")) if min_numel else comp
    child.core.encode(torch.linspace(-1, 1, 9), "w")
    assert child.core.states["w"].residual.abs().max() > 0
    comp.load_state_dict(emptied_state(comp.state_dict()))
    child = comp.child(parse("efsignsgd")) if min_numel else comp
    assert child.core.states == {}
    assert "owner" not in child.core.state_dict()
