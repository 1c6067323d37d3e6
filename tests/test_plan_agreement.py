"""Issue 13, item 3: ranks set up differently fail at the first exchange, on every rank,
with PlanMismatchError naming both sides -- not a hang, not Horovod's shape error.
One horovodrun -np 2 --gloo launch per framework, every case inside it; a missing
check fails by a case without the error or by the launch's time-out."""

import pytest

from tests.launches import TF_GLOO, TORCH_GLOO

pytestmark = pytest.mark.multiprocess

MISMATCHES = {  # case -> (field that must be named, what rank 0 and rank 1 show)
    "ratio": ("compression", ("compression='topk:ratio=0.01", "compression='topk:ratio=0.1")),
    "algorithm": ("compression", ("compression='topk:ratio=0.1", "compression='qsgd:levels=7")),
    "op": ("op", ("op='Average'", "op='Sum'")),
    "tensors": ("tensors", ("rank 0 exchanges", "only rank 1 has")),
    "delay": ("delay", ("delay=1", "delay=0")),
}


TORCH_GLOO.add(__name__, "torch_cases", "tests.workers.plan_check:torch_cases")  # (tests.launches)


@pytest.fixture(scope="module")
def torch_results(request):
    return TORCH_GLOO.results(request, "torch_cases")


TF_GLOO.add(__name__, "tf_cases", "tests.workers.plan_check:tf_cases")  # (tests.launches)


@pytest.fixture(scope="module")
def tf_results(request):
    return TF_GLOO.results(request, "tf_cases")


def _mismatch(results, case, field, shown):
    for res in results:  # every rank raises, and the same message
        got = res[case]
        assert got["error"] == "PlanMismatchError", (case, got)
        assert field in got["fields"], (case, got)
        for text in shown:
            assert text in got["message"], (case, got["message"])
        assert got["gathers"] == 2  # the digests, then the whole plans to name the fields
    assert results[0][case]["message"] == results[1][case]["message"]


def _agrees(results, case):
    for res in results:
        assert res[case]["error"] is None, (case, res[case])
        assert res[case]["gathers"] == 1, (case, res[case])  # one collective, whole run


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_torch_mismatch(torch_results, case):
    _mismatch(torch_results, case, *MISMATCHES[case])


@pytest.mark.parametrize("case, field, shown", [
    ("bpps", "backward_passes_per_step", ("backward_passes_per_step=1",
                                          "backward_passes_per_step=2")),
    ("predivide", "gradient_predivide_factor", ("gradient_predivide_factor=1.0",
                                                "gradient_predivide_factor=2.0")),
    ("local_sgd", "local_sgd", ("local_sgd='period=1,warmup=0'", "local_sgd='off'")),
    ("contract", "compression", ("compression='fp16'", "compression='bf16'"))])
def test_torch_settings_mismatch(torch_results, case, field, shown):
    _mismatch(torch_results, case, field, shown)


@pytest.mark.parametrize("case", ["same", "same_none", "same_local_sgd", "same_delay",
                                  "same_bpps", "same_contract", "after"])
def test_torch_matching_ranks_check_once(torch_results, case):
    _agrees(torch_results, case)


@pytest.mark.parametrize("mode", ["eager", "traced"])
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_tf_tape_mismatch(tf_results, mode, case):
    _mismatch(tf_results, f"{mode}_{case}", *MISMATCHES[case])


@pytest.mark.parametrize("case, field, shown", [
    ("keras_ratio", "compression", MISMATCHES["ratio"][1]),
    ("keras_op", "op", MISMATCHES["op"][1]),
    ("contract", "compression", ("compression='fp16'", "compression='bf16'"))])
def test_tf_keras_and_contract_mismatch(tf_results, case, field, shown):
    _mismatch(tf_results, case, field, shown)


@pytest.mark.parametrize("case", ["eager_same", "traced_same", "eager_same_local_sgd",
                                  "traced_same_local_sgd", "keras_same", "same_contract",
                                  "after"])
def test_tf_matching_ranks_check_once(tf_results, case):
    _agrees(tf_results, case)
