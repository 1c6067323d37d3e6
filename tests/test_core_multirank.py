"""The reference multi-rank step (hvd_compress.tools.mpi_check) under real mpirun launches."""

import subprocess
import sys

import pytest

from hvd_compress import spec as specmod
from hvd_compress.tools.mpi_check import DEFAULT_SPECS
from tests.harness import run_mpi

pytestmark = pytest.mark.multiprocess


def test_default_list_covers_every_compressor_and_compositions():
    names = {specmod.parse(s).parts[0].name for s in DEFAULT_SPECS}
    assert names == set(specmod.NAMES)
    assert any(specmod.parse(s).composed for s in DEFAULT_SPECS)


@pytest.mark.parametrize("np_", [2, 3])
def test_every_compressor_aggregates_correctly_across_ranks(np_):
    # (the ranks run numba on one thread, as every launch does: tests.harness)
    reports = run_mpi("hvd_compress.tools.mpi_check:check", np=np_, kwargs={"steps": 3})
    assert len(reports) == np_
    for spec in DEFAULT_SPECS:
        per_rank = [r[spec] for r in reports]
        for r in per_rank:
            assert r["ranks"] == np_
            assert r["ok"], f"{spec}: {r['failures']}"
        # every rank sends the same number of bytes (static payload sizes), unless
        # the sizes depend on the values (then they differ: rows of different lengths)
        sizes = {r["bytes_per_rank"] for r in per_rank}
        assert len(sizes) == 1 or specmod.parse(spec).parts[0].name in ("thresholdv", "adaq",
                                                                                 "inceptionn")
    assert reports[0]["randomk:ratio=0.01"]["ratio"] > 90
    assert reports[0]["onebit"]["ratio"] > 10
    # variable sizes really differed between ranks, and the exchange still agreed
    assert len({r["thresholdv"]["bytes_per_rank"] for r in reports}) > 1
    assert len({r["adaq:ratio=0.2"]["bytes_per_rank"] for r in reports}) > 1


def test_cli_rejects_a_bad_spec():
    proc = subprocess.run([sys.executable, "-m", "hvd_compress.tools.mpi_check",
                           "--compression", "topk:ratio=2"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "topk: ratio must be in (0, 1], got 2" in proc.stderr
