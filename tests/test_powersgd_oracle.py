"""PowerSGD against PyTorch's own ``powerSGD_hook`` (an independent implementation):
the same gradients and the same Q give the same P, Q and decompressed gradients, with
and without error feedback and warm start, in a Gloo process group of two ranks.

Intentional differences (docs/compressors.md, "PowerSGD and PyTorch's hook"): ours compresses from
the first step (the hook's ``start_powerSGD_iter`` runs uncompressed steps first), and a
matrix is compressed whenever that saves bytes (the hook's ``min_compression_rate=1``);
each rank's residual is its own approximation error (the hook keeps the error of the
mean approximation), so residuals agree summed over ranks.
"""

import socket

import pytest

from tests.harness import run_many, run_mpi

pytestmark = pytest.mark.multiprocess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = [(1, True, True), (2, True, True), (1, False, True), (1, True, False), (2, False, False)]


@pytest.fixture(scope="module")
def launched():
    """Every case in one launch (one after another, each in a process group of its own)."""
    return run_many(run_mpi, [(str(case), "tests.workers.powersgd_oracle:run",
                               {"port": _free_port(), "rank_": case[0], "ef": case[1],
                                "warm_start": case[2]}) for case in CASES], np=2, timeout=600)


@pytest.mark.parametrize("rank, ef, warm_start", CASES)
def test_powersgd_matches_pytorchs_hook(rank, ef, warm_start, launched):
    results = launched[str((rank, ef, warm_start))]
    for res in results:
        worst, checks = res["worst"], res["checks"]
        assert any(res["compressed"]) and not all(res["compressed"])
        assert checks["out"] == 6 * 5 and checks["dense"] == 6 * res["compressed"].count(False)
        assert worst["out"] < 1e-5 and worst["dense"] < 1e-6, worst  # float32 rounding
        if warm_start:  # the hook keeps P and the mean Q only with warm start
            assert checks["p_hat"] == checks["q"] == 6 * sum(res["compressed"])
            assert worst["p_hat"] < 1e-5 and worst["q"] < 1e-5, worst
        if ef:
            assert checks["residual_sum"] == 6 * sum(res["compressed"])
            assert worst["residual_sum"] < 1e-5, worst
