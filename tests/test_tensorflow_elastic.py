"""Elastic TensorFlow training (``hvd.elastic.run``) with our tape and our Keras optimizer,
on Keras 3: one ``horovodrun --min-np 2 --max-np 3 --host-discovery-script`` launch
(tests/workers/tf_elastic.py) in which a worker joins (custom loop with our tape and
``hct.elastic.TensorFlowState``) and then leaves (Keras ``fit`` with our optimizer,
``hct.elastic.KerasState`` and Horovod's elastic Keras callbacks)."""

import json
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.harness import HOROVODRUN, LaunchError, _run
from tests.workers.tf_elastic import EPOCHS, JOIN_AFTER, LEAVE_AT, TAPE_BATCHES

pytestmark = pytest.mark.multiprocess


def run_horovod_elastic_tf(target: str, np: int, min_np: int, max_np: int,
                           kwargs: dict | None = None, timeout: float = 600) -> dict:
    """Launch ``target`` elastically on localhost; the discovery script prints the file
    whose path the workers get as ``hosts_file`` (they rewrite it to add or remove slots).
    Returns every worker's result by its first rank (workers that joined included)."""
    with tempfile.TemporaryDirectory(prefix="hvd-elastic-") as outdir:
        hosts = Path(outdir, "hosts")
        hosts.write_text(f"localhost:{np}\n")
        script = Path(outdir, "discover.sh")
        script.write_text(f"#!/bin/sh\ncat {hosts}\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        Path(outdir, "kwargs.json").write_text(json.dumps({**(kwargs or {}),
                                                           "hosts_file": str(hosts)}))
        cmd = [*HOROVODRUN, "-np", str(np), "--min-np", str(min_np), "--max-np",
               str(max_np), "--host-discovery-script", str(script),
               # one host: no second one to find a common interface with
               "--network-interface", "lo", "--elastic-timeout", "240",
               sys.executable, "-m", "tests.workers.entry", target]
        # a joining worker imports TensorFlow while the others wait in Gloo's rendezvous
        out = _run(cmd, outdir, max_np, timeout, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "180"})
        results = {int(p.stem[7:]): json.loads(p.read_text())
                   for p in Path(outdir).glob("partial*.json")}  # (what a worker saw so far)
        finished = [json.loads(p.read_text()) for p in Path(outdir).glob("worker*.json")]
        results.update({r["first_rank"]: r for r in finished})  # (tests.workers.entry, elastic)
        if not results:
            raise LaunchError(f"no worker wrote a result\n{out}")
        return results


@pytest.fixture(scope="module")
def workers():
    return run_horovod_elastic_tf("tests.workers.tf_elastic:elastic", np=2, min_np=2, max_np=3,
                                  timeout=600)


def test_horovods_own_keras_states_fail_on_keras_3(workers):
    for name, err in workers[0]["horovod"].items():
        assert err is not None and "not callable" in err, (name, err)  # optimizer.variables()


def test_a_worker_joins_the_tape_loop(workers):
    assert set(workers) == {0, 1, 2}
    for first in (0, 1):
        w = workers[first]
        assert "error" not in w, w.get("error")
        steps = [e for e in w["tape"] if e["event"] == "step"]
        assert [e["batch"] for e in steps] == list(range(TAPE_BATCHES))
        assert [e["size"] for e in steps] == [2] * JOIN_AFTER + [3] * (TAPE_BATCHES - JOIN_AFTER)
        # every step: one model and one PowerSGD Q / step counter on every rank, the
        # compressor bound to this rank and the world size of the moment
        assert all(e["weights_agree"] and e["shared_agree"] and e["bound"] for e in steps)
        assert [e["steps"] for e in steps] == list(range(1, TAPE_BATCHES + 1))
        # the survivors kept their residuals through the reset
        restart = [e for e in w["tape"] if e["event"] == "start"][1]
        assert restart["size"] == 3 and restart["batch"] == JOIN_AFTER
        assert restart["residuals"] == steps[JOIN_AFTER - 1]["residuals"]
    joined = workers[2]
    assert joined["first_rank"] == 2 and joined["first_size"] == 3
    steps = [e for e in joined["tape"] if e["event"] == "step"]
    assert [e["batch"] for e in steps] == list(range(JOIN_AFTER, TAPE_BATCHES))
    assert all(e["weights_agree"] and e["shared_agree"] and e["bound"] for e in steps)
    # rank 0's counters (not a fresh 1) after the sync
    assert steps[0]["steps"] == JOIN_AFTER + 1
    np.testing.assert_allclose(np.concatenate([np.ravel(w) for w in joined["tape_weights"]]),
                               np.concatenate([np.ravel(w) for w in workers[0]["tape_weights"]]),
                               rtol=0, atol=1e-6)


def test_a_worker_leaves_keras_fit(workers):
    for first in (0, 1):
        w = workers[first]
        assert "error" not in w, w.get("error")
        assert w["epoch"] == EPOCHS and w["last_size"] == 2
        batches = [e for e in w["keras"] if e["event"] == "batch"]
        assert all(e["weights_agree"] and e["bound"] for e in batches)
        sizes = [e["size"] for e in batches]
        left = next(i for i, e in enumerate(batches)
                    if (e["epoch"], e["batch"]) == LEAVE_AT) + 1
        assert sizes[:left] == [3] * left and sizes[left:] == [2] * (len(sizes) - left)
        # Keras 3 runs the interrupted epoch in full: 4 batches an epoch, once more for it
        assert len(batches) == 4 * EPOCHS + LEAVE_AT[1] + 1
        restart = [e for e in w["keras"] if e["event"] == "start"][1]
        assert restart["size"] == 2 and restart["epoch"] == LEAVE_AT[0]
        assert restart["residuals"] == batches[left - 1]["residuals"]  # kept
    assert workers[0]["keras_weights"] == workers[1]["keras_weights"]
    assert "keras_weights" not in workers[2]  # the worker that left did not finish
