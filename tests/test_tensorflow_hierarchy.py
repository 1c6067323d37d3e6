"""The hierarchical exchange in TensorFlow under 4 workers in 2 simulated nodes
(python -m hvd_compress.tools.nodesrun; Gloo, the node process sets at init)."""

import pytest

from tests.launches import TF_NODES

pytestmark = pytest.mark.multiprocess


def test_tape_aggregate_is_its_definition_eagerly_and_traced():
    results = TF_NODES("tf-nodes", "hierarchy")  # (one launch with tests/test_tensorflow_twophase.py)
    for res in results:
        for key, r in res["report"].items():
            assert r["hierarchical"], key
            assert r["rel_err"] < 1e-5, (key, r["rel_err"])
            if key.endswith("|eager"):  # the account: the shards' payloads between nodes
                assert r["bytes_sent"] == r["formula_bytes"], (key, r["bytes_sent"])
                spec = key.split("|")[0]
                assert (r["local_bytes"] > 0) == (spec != "none"), key  # none goes flat
