"""Issue 13, item 3: a worker that dies mid-training ends the whole launch.

Rank 1 of ``horovodrun -np 2 --gloo`` exits at step 3 without a word; rank 0 is
then inside (or about to start) a collective.  The launch must end with a
non-zero status within 60 s of the death, and leave no process behind.  With
Horovod 0.28.1's defaults it does: Gloo's connection to the dead peer resets,
and horovodrun terminates the remaining workers once one exits non-zero.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import psutil
import pytest

from tests.harness import REPO, _bin, _env

pytestmark = pytest.mark.multiprocess

LIMIT = 60       # seconds from the death to the launch's end
STARTUP = 120    # seconds to import the frameworks and reach step 3 (2 shared cores)


def _left_behind(marker: str) -> list:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_dead_worker_ends_the_launch(framework):
    marker = f"hvdc-dead-{uuid.uuid4().hex[:12]}"
    cmd = [_bin("horovodrun"), "-np", "2", "--gloo", "-H", "localhost:2", sys.executable,
           str(REPO / "tests" / "workers" / "dead_worker.py"), framework, marker, "--die-at", "3"]
    with tempfile.TemporaryDirectory(prefix="hvd-test-") as outdir:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(outdir, None), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=STARTUP + LIMIT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"the launch did not end in {STARTUP + LIMIT}s:\n{out}")
        ended = time.time()
    death = re.search(r"DYING (\d+\.\d+)", out)
    assert death, out
    assert proc.returncode != 0, out
    after = ended - float(death.group(1))
    print(f"{framework}: the launch ended {after:.1f}s after rank 1 died, status {proc.returncode}")
    assert after < LIMIT, out
    deadline = time.monotonic() + 10
    while _left_behind(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _left_behind(marker)
    for p in left:  # clean up before failing
        p.kill()
    assert not left, [p.info["cmdline"] for p in left]
