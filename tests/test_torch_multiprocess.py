"""hvd_compress.torch under real horovodrun -np 2 launches (Gloo and MPI)."""

import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch

from hvd_compress.core import build
from tests.harness import run_horovod
from tests.launches import TORCH_GLOO, TORCH_MPI
from tests.workers.torch_opt import SPECS

pytestmark = pytest.mark.multiprocess

# Model, gradients, payloads and compressor state on the GPU (ranks share one where there is
# only one; a Horovod built without NCCL stages CUDA tensors through host memory).
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"))
DEVICES = ["cpu", CUDA]
BPPS_SPECS = ["none", "topk:ratio=0.1", "onebit", "randomk:ratio=0.1", "qsgd:levels=7"]
MISSING_SPECS = ["topk:ratio=0.1", "onebit", "dgc:ratio=0.1,momentum=0"]
CKPT_SPECS = ["topk:ratio=0.1", "dgc:ratio=0.05", "qsgd:levels=7", "powersgd:rank=2",
              "randomk:ratio=0.1+fp16"]


# The CPU cases: one launch per controller, shared with other modules' np 2 bodies
# (tests.launches; the cases run one after another, each with its own model and optimizer).
# The checkpoint's first halves on the CPU run there too; its resumes (a fresh launch is
# the point) and the CUDA cases launch on their own.
_W = "tests.workers.torch_opt:"
_TMP = tempfile.mkdtemp(prefix="hvd-test-resume-")
atexit.register(shutil.rmtree, _TMP, True)
_RESUME, _CKPT = os.path.join(_TMP, "ckpt.pt"), os.path.join(_TMP, "phases")


def _register(w=_W):
    gloo = [("reference", w + "aggregate_matches_reference", {"device": "cpu"}),
            ("bpps", w + "aggregate_matches_reference",
             {"specs": BPPS_SPECS, "bpps": 2, "steps": 2, "device": "cpu"}),
            ("horovod_own", w + "horovod_own_optimizer", {"device": "cpu"}),
            ("ckpt_run", w + "checkpoint_phases",
             {"specs": CKPT_SPECS, "path": _CKPT, "phase": "run", "device": "cpu"}),
            *[(f"missing:{s}", w + "state_survives_missing_grads", {"spec": s}) for s in MISSING_SPECS],
            ("broadcast_every", w + "broadcast_every_optimizer", {})]
    mpi = [("reference", w + "aggregate_matches_reference", {"device": "cpu"}),
           ("resume_with_broadcast", w + "resume_with_broadcast",
            {"path": _RESUME})]
    for call in gloo:
        TORCH_GLOO.add(__name__, *call)
    for call in mpi:
        TORCH_MPI.add(__name__, *call)


_register()


@pytest.fixture(scope="module")
def launched(request):
    """``launched(controller, key)``: per-rank results of a CPU case."""
    shared = {"gloo": TORCH_GLOO, "mpi": TORCH_MPI}
    return lambda controller, key: shared[controller].results(request, key)


@pytest.mark.parametrize("controller,device", [("gloo", "cpu"), ("mpi", "cpu"),
                                               pytest.param("gloo", *CUDA.values,
                                                            marks=CUDA.marks)])
def test_every_compressor_matches_the_numpy_reference(controller, device, launched):
    results = launched(controller, "reference") if device == "cpu" else \
        run_horovod("tests.workers.torch_opt:aggregate_matches_reference", np=2,
                    controller=controller, timeout=600, kwargs={"device": device})
    for res in results:
        assert set(res["report"]) == set(SPECS)
        for spec, r in res["report"].items():
            assert r["rel_err"] < (1e-3 if "powersgd" in spec else 2 ** -7), spec
            assert r["bytes_sent"] > 0
    # ranks send the same number of bytes per step (but where sizes depend on the values)
    fixed = [s for s in SPECS if not build(s).variable_size]
    assert all(results[0]["report"][s]["bytes_sent"] == results[1]["report"][s]["bytes_sent"]
               for s in fixed)
    rep = results[0]["report"]
    assert rep["topk:ratio=0.1"]["bytes_sent"] < rep["none"]["bytes_sent"] / 4
    assert rep["powersgd:rank=2"]["collectives"] > rep["topk:ratio=0.1"]["collectives"]
    # variable sizes sent in opposite orders on the two ranks: no deadlock, and the
    # reference aggregate (two groups: lengths and rows each)
    for res in results:
        assert res["different_orders"]["rel_err"] < 1e-5
        assert res["different_orders"]["collectives"] == 4
        assert res["int32_wrap"]["got"] == res["int32_wrap"]["want"]
    # integer sums: two collectives (the max of the scales, the sum of the codes) per step
    for spec in ("terngrad:sum=int", "qsgd:sum=int,levels=5", "signsgd:sum=int"):
        assert rep[spec]["collectives"] == 2 * rep["none"]["collectives"], spec


@pytest.mark.parametrize("device", DEVICES)
def test_backward_passes_per_step_matches_accumulating_by_hand(device, launched):
    specs = BPPS_SPECS
    results = launched("gloo", "bpps") if device == "cpu" else \
        run_horovod("tests.workers.torch_opt:aggregate_matches_reference", np=2,
                    kwargs={"specs": specs, "bpps": 2, "steps": 2, "device": device}, timeout=600)
    for res in results:
        assert set(res["report"]) == set(specs)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_resumes_bit_identically_in_a_fresh_launch(tmp_path, device, launched):
    """Every kind of compressor state (residual, DGC's u and v, the noise generator,
    PowerSGD's Q, shared random-k indices) through torch.save and a fresh launch: the
    first halves in one launch (on the CPU the shared Gloo one), the resumes in another."""
    specs, path = CKPT_SPECS, str(tmp_path / "ckpt")
    if device == "cpu":
        full, path = launched("gloo", "ckpt_run"), _CKPT
    else:
        full = run_horovod("tests.workers.torch_opt:checkpoint_phases", np=2,
                           kwargs={"specs": specs, "path": path, "phase": "run", "device": device})
    resumed = run_horovod("tests.workers.torch_opt:checkpoint_phases", np=2,
                          kwargs={"specs": specs, "path": path, "phase": "resume", "device": device})
    for spec in specs:
        for a, b in zip(full, resumed):
            assert a[spec]["params"] == b[spec]["params"], spec
        assert full[0][spec]["params"] == full[1][spec]["params"], spec  # ranks agree


@pytest.mark.parametrize("device", DEVICES)
def test_summable_compressors_in_horovods_own_optimizer(device, launched):
    results = launched("gloo", "horovod_own") if device == "cpu" else \
        run_horovod("tests.workers.torch_opt:horovod_own_optimizer", np=2, timeout=600,
                    kwargs={"device": device})
    for res in results:
        assert set(res["report"]) == {"fp16", "bf16", "randomk:ratio=0.1", "powersgd:rank=2", "none"}
        assert "cannot run inside horovod.torch.DistributedOptimizer" in res["topk_error"]
        assert "hvd_compress.torch.DistributedOptimizer" in res["topk_error"]


@pytest.mark.parametrize("spec", MISSING_SPECS)
def test_state_survives_set_to_none_and_missing_gradients(spec, launched):
    results = launched("gloo", f"missing:{spec}")
    for res in results:
        assert res["worst"] < 1e-4
        assert set(res["steps"].values()) == {6}  # every parameter took part in every step


def test_resume_from_a_checkpoint_with_horovods_broadcast_pattern(launched):
    """Issue 13: broadcast_optimizer_state with a lazily made state (Adam) on some ranks
    only used to spin forever; torch.load's defaults refused our checkpoints.  Under MPI
    (the every-optimizer test below runs the same broadcast under Gloo)."""
    results = launched("mpi", "resume_with_broadcast")
    for spec in ("none", "topk:ratio=0.1", "randomk:ratio=0.3", "powersgd:rank=1"):
        a, b = results[0][spec], results[1][spec]
        assert a["moments"] == b["moments"]  # rank 1 received rank 0's Adam state
        assert any(v != 0 for m in a["moments"] for v in m)
        assert a["params"] == b["params"], spec  # and training went on in agreement
        if spec != "none":  # rank 1 took rank 0's counters (2 steps before the save, 2 after)
            assert a["steps"] == b["steps"] and set(a["steps"]) == {4}, (spec, a["steps"], b["steps"])


def test_broadcast_optimizer_state_for_every_optimizer_and_rank_combination(launched):
    """Issue 13: broadcast_optimizer_state for every torch.optim optimizer Horovod takes,
    with state on no rank, on rank 0 only and on every rank, returns (no rank steps an
    exchange alone), leaves rank 0's state on every rank, and ours (compression none)
    holds the same state and takes the same next step as Horovod's optimizer -- except
    that ours puts the parameters back after the zero-gradient step that makes the state
    (Horovod's leaves weight decay's change there, and its ranks train apart)."""
    runs = launched("gloo", "broadcast_every")
    r0, r1 = runs
    names = sorted({k.split(":")[0] for k in r0})
    for must in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "NAdam",
                 "RAdam", "ASGD", "Rprop", "SparseAdam"):
        assert must in names, names
    horovod_moved = {k.rsplit(":", 1)[0] for k in r0 if k.endswith(":horovod")
                     and (r0[k]["moved"] or r1[k]["moved"])}
    for key in r0:
        name, case, wrapper = key.split(":")
        a, b = r0[key], r1[key]
        assert a["after"] == b["after"], key  # every rank holds the same state
        if case != "none":  # rank 0's state, as it was, reached rank 1
            assert any(a["before"]["state"]), key
            assert b["after"]["state"] == a["before"]["state"], key
        if case == "root":  # rank 1 had none (Adagrad's, made at construction, differs)
            assert b["before"]["state"] != a["before"]["state"], key
        if wrapper == "horovod":
            if f"{name}:{case}" not in horovod_moved:
                assert a["params"] == b["params"], key
            continue
        assert not a["moved"] and not b["moved"], key  # the state-making step moved nothing
        assert a["params"] == b["params"], key  # and the ranks took the same step
        theirs = r0[f"{name}:{case}:horovod"]
        assert a["after"] == theirs["after"], key
        if f"{name}:{case}" not in horovod_moved:  # as Horovod's, where it moved nothing
            np.testing.assert_allclose(a["params"], theirs["params"], rtol=0, atol=1e-6,
                                       err_msg=key)
    assert "AdamW:root" in horovod_moved  # (what ours mends: weight decay on a zero gradient)
    assert "Adam:root" not in horovod_moved
