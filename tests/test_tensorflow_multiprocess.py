"""hvd_compress.tensorflow under real horovodrun -np 2 launches (Gloo and MPI)."""

import pytest

from hvd_compress.core import build
from tests.launches import TF_GLOO, TF_MPI
from tests.workers.tf_tape import SPECS

pytestmark = pytest.mark.multiprocess

BPPS_SPECS = ["none", "topk:ratio=0.1", "onebit", "randomk:ratio=0.1", "powersgd:rank=2"]


W = "tests.workers.tf_tape:"


def _reference(traced):
    return (f"reference:{traced}", W + "aggregate_matches_reference", {"traced": traced})


def _bpps(traced):
    return (f"bpps:{traced}", W + "aggregate_matches_reference",
            {"specs": BPPS_SPECS, "bpps": 2, "traced": traced})


# one launch per controller, shared with other modules' np 2 bodies (tests.launches; the
# cases run one after another, each with its own variables and tapes)
_OWN = ("horovod_own", W + "horovod_own_tape", {})
for _call in [_reference(True), _OWN, _bpps(False), ("state", W + "state_ownership", {})]:
    TF_GLOO.add(__name__, *_call)
for _call in [_reference(False), _OWN, _bpps(True)]:
    TF_MPI.add(__name__, *_call)


@pytest.fixture(scope="module")
def launched(request):
    """``launched(controller, key)``: per-rank results of a case from the controller's
    shared launch."""
    shared = {"gloo": TF_GLOO, "mpi": TF_MPI}
    return lambda controller, key: shared[controller].results(request, key)


# Pairwise: each controller and each execution mode once (the controller moves the bytes,
# the mode decides the code that makes them; test_torch_multiprocess.py runs both
# controllers over every compressor).
@pytest.mark.parametrize("controller, traced", [("gloo", True), ("mpi", False)])
def test_tape_matches_the_numpy_reference(controller, traced, launched):
    """Deterministic compressors against the numpy core's replay of every rank; stochastic
    ones (their noise is TF's own) eagerly against the numpy core's aggregation of the
    payloads every rank sent, and traced by the ranks' agreement (checked in the worker)."""
    results = launched(controller, f"reference:{traced}")
    for res in results:
        assert set(res["report"]) == set(SPECS)
        for spec, err in res["report"].items():
            if traced and (build(spec).draws_noise or build(spec).variable_size):
                assert err is None
                continue
            limit = {"powersgd:rank=2": 1e-4, "bf16": 2 ** -7}.get(spec, 1e-6)
            assert err is not None and err < limit, (spec, err)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_summable_compressors_in_horovods_own_tape(controller, launched):
    results = launched(controller, "horovod_own")
    for res in results:
        rep = res["report"]
        assert all(info["ranks_agree"] for info in rep.values())
        assert rep["fp16"]["err"] < 1e-3
        assert rep["randomk:ratio=0.1"]["kept"] == [20, 2, 7, 1]  # k = ceil(0.1 n) per tensor
        assert rep["randomk:ratio=0.1"]["err"] == 0.0
        assert rep["powersgd:rank=2"]["ranks"] == [2, 2] and rep["powersgd:rank=2"]["shrinks"]
        assert rep["powersgd:rank=2"]["vectors_exact"] < 1e-6  # vectors travel dense
        # and the numpy core's replay of every rank over two steps (Q warm-started), as
        # test_summable_compressors_in_horovods_own_optimizer does for torch
        assert rep["powersgd:rank=2"]["err"] < 1e-4, rep["powersgd:rank=2"]["err"]
        assert "cannot run inside horovod.tensorflow" in res["topk_error"]
        assert "hvd_compress.tensorflow.DistributedGradientTape" in res["topk_error"]


@pytest.mark.parametrize("controller, traced", [("gloo", False), ("mpi", True)])
def test_backward_passes_per_step_matches_accumulating_by_hand(controller, traced, launched):
    results = launched(controller, f"bpps:{traced}")
    for res in results:
        for spec, err in res["report"].items():
            assert err < (1e-4 if "powersgd" in spec else 1e-5), (spec, err)


def test_state_belongs_to_its_user(launched):
    results = launched("gloo", "state")
    for res in results:
        assert res["same_model_shares"] and res["models_apart"] and res["object_shared"]
        assert res["steps_on_a"] == [2]  # two tapes over model a, one compressor's step counter
        assert res["bpps"] == [False, False, True]  # model b's pass does not complete a's
        assert res["keras_apart"]
        assert res["named"] == "TopK"
