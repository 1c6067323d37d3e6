"""Launches that several test modules share: one launch per pytest run serves them all
(:func:`tests.harness.shared_launches`; each module's tests ask for their bodies' results).

``TF_NODES``: TensorFlow under 4 workers in 2 simulated nodes (Gloo, node process sets at
init): the hierarchy's bodies (tests/test_tensorflow_hierarchy.py) and the two-phase
exchange's (tests/test_tensorflow_twophase.py).  The two-phase body names its exchange
(``exchange="two-phase"``: the pinned hierarchy only stands for ``"auto"``) and runs over
the whole world, whose links the simulated nodes leave as they are; one launch of TensorFlow
workers (the import and ``hvd.init`` of four processes) instead of two."""

from __future__ import annotations

from tests.harness import run_nodes, shared_launches

TF_NODES = shared_launches({"tf-nodes": (run_nodes, [
    ("hierarchy", "tests.workers.tf_hierarchy:tape_matches_definition", {}),
    ("two-phase", "tests.workers.tf_twophase:tape_matches_definition", {})],
    {"nodes": 2, "np": 4, "timeout": 900, "env": {"HVD_COMPRESS_EXCHANGE": "hierarchical"}})})
