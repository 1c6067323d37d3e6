"""The hierarchical exchange in PyTorch under 4 workers in 2 simulated nodes
(python -m hvd_compress.tools.nodesrun; Gloo, process sets at init and added after)."""

import pytest

from tests.harness import run_nodes
from tests.workers.torch_hierarchy import SPECS

pytestmark = pytest.mark.multiprocess
#: the wrappers' hierarchy where the node sets are registered (the workers' "auto" key)
HIER = {"HVD_COMPRESS_EXCHANGE": "hierarchical"}


@pytest.mark.parametrize("dynamic", [False, True])
def test_hierarchical_aggregate_is_its_definition_and_flat_stays_flat(dynamic):
    results = run_nodes("tests.workers.torch_hierarchy:aggregate_matches_definition", nodes=2,
                        np=4, kwargs={"dynamic": dynamic, "specs": SPECS if not dynamic else
                                      ["topk:ratio=0.1", "none"]},
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1", **HIER} if dynamic else HIER)
    for res in results:
        rep = res["report"]
        assert rep["sets"] == [[0, 1], [2, 3], [0, 2], [1, 3]]
        for key, r in rep.items():
            if "|" not in key:
                continue
            spec, mode = key.split("|")
            summable = spec in ("none", "randomk:ratio=0.1")
            assert r["hierarchical"] == (mode == "auto"), key
            assert r["rel_err"] < 1e-5, (key, r["rel_err"], r["worst_at"])
            if mode == "auto" and not summable:
                assert r["bytes_sent"] == [r["formula_bytes"]] * len(r["bytes_sent"]), key
                assert r["local_bytes"] > 0
                flat = rep[f"{spec}|flat"]["bytes_sent"][0]
                assert r["bytes_sent"][0] < 0.6 * flat, key  # half a tensor's payload, about
        assert "node process sets" in rep["refusal"]
