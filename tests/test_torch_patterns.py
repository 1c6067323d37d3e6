"""Horovod's documented PyTorch patterns with our optimizer, next to Horovod's own.

Written from Horovod's documentation (gradient clipping with ``synchronize()``
and ``skip_synchronize()``; ``hvd.join()`` for uneven data), each under a real
``horovodrun -np 2`` launch under Gloo and under MPI (tests/workers/torch_patterns.py; the
allgather-payload join case under Gloo only).
"""

import numpy as np
import pytest

from tests.harness import LaunchError, run_horovod

pytestmark = pytest.mark.multiprocess


CONTROLLERS = ["gloo", "mpi"]  # every pattern under both of Horovod's controllers


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_clipping_between_synchronize_and_step_is_horovods(controller):
    runs = run_horovod("tests.workers.torch_patterns:clipping", np=2, timeout=300,
                       controller=controller)
    for rank in runs:
        for ours, theirs in zip(rank["ours:none"], rank["horovod:None"]):
            np.testing.assert_allclose(ours["norm"], theirs["norm"], rtol=1e-6)
            for a, b in zip(ours["params"], theirs["params"]):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        assert sum(e["norm"] > 0.2 for e in rank["ours:none"]) >= 2  # clipping was active
        assert any(e["norm"] > 0.2 for e in rank["ours:topk:ratio=0.3"])
    assert runs[0]["ours:topk:ratio=0.3"] == runs[1]["ours:topk:ratio=0.3"]  # ranks agree


@pytest.mark.parametrize("spec, controller", [("none", "gloo"), ("randomk:ratio=0.3", "gloo"),
                                              ("none", "mpi")])
def test_join_with_uneven_batches(spec, controller):
    """Allreduce payloads (none, the summable compressors): the ranks that joined add
    zeros, as in Horovod; with none the parameters are Horovod's."""
    runs = run_horovod("tests.workers.torch_patterns:join_uneven", np=2, timeout=120,
                       kwargs={"spec": spec}, controller=controller)
    for rank in runs:
        assert rank["ours"]["last"] == 0  # rank 0 ran the most batches: it joined last
        if spec == "none":
            assert rank["horovod"]["last"] == 0
            for a, b in zip(rank["ours"]["params"], rank["horovod"]["params"]):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_join_with_an_allgather_compressor_fails_fast():
    """Horovod 0.28.1 runs only allreduce while ranks have joined: an allgather payload
    (top-k) then stops its background loop on the joined rank.  The launch must end with
    an error, not hang (README: "Coming from Horovod")."""
    with pytest.raises(LaunchError, match="exit code"):
        run_horovod("tests.workers.torch_patterns:join_uneven", np=2, timeout=120,
                    kwargs={"spec": "topk:ratio=0.3"})


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_ops_as_horovods(controller):
    for rank in run_horovod("tests.workers.torch_patterns:ops", np=2, timeout=120,
                            controller=controller):
        for op in ("Sum", "Min"):
            for a, b in zip(rank[f"ours:{op}"], rank[f"horovod:{op}"]):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        assert rank["ours:Sum"] != rank["ours:Min"]
        assert "op must be Average or Sum" in rank["refused:Min"]
        assert "Adasum" in rank["refused:Adasum"]


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_process_set(controller):
    runs = run_horovod("tests.workers.torch_patterns:process_set", np=3, timeout=180,
                       controller=controller)
    for rank in runs[:2]:
        for a, b in zip(rank["ours:none"], rank["horovod:None"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert runs[0]["ours:none"] == runs[1]["ours:none"]
    assert runs[0]["ours:topk:ratio=0.3"] == runs[1]["ours:topk:ratio=0.3"]
    assert runs[2]["ours:none"] == runs[2]["horovod:None"]  # alone: its own gradients
    assert runs[2]["ours:none"] != runs[0]["ours:none"]
