"""hvd_compress.tools.mwms: the launcher of TensorFlow's MultiWorkerMirroredStrategy
baseline (TF_CONFIG per worker; a failing worker stops the rest; a time-out)."""

import json
import subprocess
import sys
import time

from hvd_compress.tools import mwms
from tests.harness import REPO


def test_tf_config_names_the_cluster_and_the_task():
    cfg = json.loads(mwms.tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1))
    assert cfg == {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                   "task": {"type": "worker", "index": 1}}
    ports = mwms.free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


def test_every_worker_gets_its_index_and_a_share_of_the_cores(capfd):
    code = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
            "print(c['task']['index'], len(c['cluster']['worker']), os.environ['HVD_COMPRESS_THREADS'])")
    assert mwms.run([sys.executable, "-c", code], 2, timeout=60) == 0
    out = capfd.readouterr().out
    assert "[0]<stdout>:0 2" in out and "[1]<stdout>:1 2" in out


def test_a_failing_worker_stops_the_others_with_its_status():
    code = "import json, os, sys, time; i = json.loads(os.environ['TF_CONFIG'])['task']['index']; " \
           "sys.exit(3) if i == 0 else time.sleep(120)"
    t0 = time.monotonic()
    assert mwms.run([sys.executable, "-c", code], 2, timeout=100) == 3
    assert time.monotonic() - t0 < 30


def test_time_out_stops_every_worker():
    t0 = time.monotonic()
    assert mwms.run([sys.executable, "-c", "import time; time.sleep(120)"], 2, timeout=2) == 124
    assert time.monotonic() - t0 < 30


def test_help():
    out = subprocess.run([sys.executable, "-m", "hvd_compress.tools.mwms", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "TF_CONFIG" in out.stdout and "-np" in out.stdout


def test_workers_share_the_cores_this_process_may_use_not_the_machines(monkeypatch):
    """Under taskset or a cpuset the launchers divide the cores given, not os.cpu_count():
    4 workers on 12 of 16 cores take 3 threads each (with cpu_count, 4: 16 on 12 cores)."""
    import os

    from hvd_compress.tools import runtools, workers
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4, 16)))
    monkeypatch.delenv("HVD_COMPRESS_THREADS", raising=False)
    assert workers.usable_cores() == 12
    assert runtools.worker_threads(4) == 3 and runtools.worker_threads(24) == 1
