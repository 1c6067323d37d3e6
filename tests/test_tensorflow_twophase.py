"""The two-phase exchange in TensorFlow under 4 workers (Gloo; the launch of
tests/test_tensorflow_hierarchy.py, tests.launches.TF_NODES: two simulated nodes, which the
exchange over the whole world does not see): the tape's
averaged gradients are bit for bit the numpy definition
(:func:`hvd_compress.core.twophase.reference`) eagerly, and within float rounding inside
tf.function (grappler may rearrange the 1-bit column means' arithmetic: one ulp seen)."""

import pytest

from tests.launches import TF_NODES
from tests.workers.tf_twophase import SPECS

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results():
    return TF_NODES("tf-nodes", "two-phase")


@pytest.mark.parametrize("mode", ["eager", "traced"])
@pytest.mark.parametrize("spec", SPECS)
def test_tape_two_phase_is_its_definition(results, spec, mode):
    for res in results:
        r = res["report"][f"{spec}|{mode}"]
        assert r["engine"] == "TFTwoPhase"
        assert r["two_phase"], spec  # (some tensors took it: the check has teeth)
        assert {n for n, e in r["plan"].items() if e == "two-phase"} == set(r["two_phase"])
        assert r["max_diff"] <= (0.0 if mode == "eager" else 1e-7), \
            (spec, mode, r["max_diff"], r["worst_at"])
        if mode == "eager":
            assert r["wire_in"] > 0
