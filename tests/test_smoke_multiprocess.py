"""Real multi-process launches: Horovod (Gloo and MPI) for PyTorch and TensorFlow, and mpi4py."""

import pytest

from tests.harness import LaunchError, run_mpi
from tests.launches import TF_GLOO, TF_MPI, TORCH_GLOO, TORCH_MPI

pytestmark = pytest.mark.multiprocess

# the Horovod collectives run in the np 2 launches other modules share (tests.launches)
SHARED = {("torch", "gloo"): TORCH_GLOO, ("torch", "mpi"): TORCH_MPI,
          ("tensorflow", "gloo"): TF_GLOO, ("tensorflow", "mpi"): TF_MPI}
for (_framework, _), _launch in SHARED.items():
    _launch.add(__name__, "collectives", f"tests.workers.smoke:{_framework}_collectives")


def _check_collectives(results, size=2):
    expect_sum = [sum(i + 10.0 * r for r in range(size)) for i in range(6)]
    expect_col = [float(r) for r in range(size) for _ in range(r + 1)]
    assert [res["rank"] for res in results] == list(range(size))
    for res in results:
        assert res["size"] == size
        assert res["sum"] == expect_sum
        assert res["gather_rows"] == size * (size + 1) // 2
        assert res["gather_first_col"] == expect_col


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_torch_allreduce_allgather(controller, request):
    _check_collectives(SHARED["torch", controller].results(request, "collectives"))


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_tensorflow_allreduce_allgather(controller, request):
    _check_collectives(SHARED["tensorflow", controller].results(request, "collectives"))


def test_mpi4py_allgather_two_ranks():
    results = run_mpi("tests.workers.smoke:mpi4py_allgather", np=2)
    for res in results:
        assert res["gathered"] == [0, 1, 1]


def test_harness_reports_worker_failure():
    with pytest.raises(LaunchError) as info:
        run_mpi("tests.workers.smoke:fail_on_rank_one", np=2, timeout=120)
    assert "deliberate failure on rank 1" in str(info.value)


def test_harness_times_out():
    with pytest.raises(LaunchError) as info:
        run_mpi("tests.workers.smoke:sleep", np=2, kwargs={"seconds": 60}, timeout=5)
    assert "timed out" in str(info.value)
