"""Stopping hvd-compress-compare with real signals: Ctrl-C (SIGINT to its process group, as a
terminal sends it) and SIGTERM end the whole matrix within seconds, with status 130 / 143,
keep the rows done (``--resume`` runs the rest) and leave no process, namespace, link or
qdisc behind -- also when the signal lands while a run starts, and under the simulated
nodes' and the capped links' launchers, whose workers run in sessions of their own."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest

from hvd_compress.tools import netcap
from tests.harness import REPO

pytestmark = pytest.mark.multiprocess
CAPPED_OK, CAPPED_WHY = netcap.available()
# the synthetic example at its smallest: a run takes a few seconds, most of it start-up
TINY = ("--width 4 --blocks 1 --num-classes 10 --image-size 8 --batch-size 2 "
        "--num-warmup-batches 1 --num-iters 1 --num-batches-per-iter 1")
SOON = 10.0  # seconds from the signal to compare's exit (a loaded 2-core machine)


def _command(out, *args):
    """compare's command line; ``args`` may name another ``--np`` (the last one counts)."""
    return [sys.executable, str(REPO / "scripts" / "compare.py"), "--out", str(out), "--quiet",
            "--example-args", TINY, "--np", "2", *args]


def _from_a_terminal():
    """What a shell at a terminal starts a command with: the stop signals at their defaults
    (a test run in the background, ``cmd &`` in a script, inherits SIGINT ignored, which
    compare rightly leaves ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _start(out, *args):
    """compare in a session of its own (its process group is the one a terminal signals)."""
    log = open(out.parent / f"{out.name}.txt", "w")
    proc = subprocess.Popen(_command(out, *args), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=_from_a_terminal)
    proc.output = log.name
    return proc


def _processes(marker: str, also: str = "") -> list[int]:
    """Processes whose command line holds ``marker`` (and ``also``): the test's out dir is
    on every launcher's and worker's command line (the example's --json path)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in line and also in line and "compare.py" not in line:
            found.append(int(pid))
    return found


def _until(cond, proc, timeout=120.0, what=""):
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"compare ended ({proc.returncode}) before {what}: {open(proc.output).read()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {what} after {timeout:.0f}s: {open(proc.output).read()}")
        time.sleep(0.005)


def _stopped(proc, sig, to_group, expected):
    """Send ``sig`` (to the group, as a terminal, or to compare alone); compare must end
    within :data:`SOON` with ``expected`` and say so.  Returns its output."""
    t0 = time.monotonic()
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    try:
        proc.wait(timeout=SOON)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"compare still running {SOON:.0f}s after {sig!r}: {open(proc.output).read()}")
    text = open(proc.output).read()
    assert proc.returncode == expected, text
    assert f"compare: stopped by {signal.Signals(sig).name} after " in text, text
    assert "--resume continues" in text and "Traceback" not in text, text
    print(f"{signal.Signals(sig).name}: compare ended {time.monotonic() - t0:.2f}s after it")
    return text


def _nothing_left(marker: str) -> None:
    deadline = time.monotonic() + 5.0  # killed processes vanish at once; a margin for the kernel
    while _processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes(marker) == [], [open(f"/proc/{p}/cmdline").read() for p in _processes(marker)]


def _rows(out):
    path = out / "results.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_ctrl_c_ends_the_matrix_keeps_the_rows_done_and_resume_runs_the_rest(tmp_path):
    """Two runs: Ctrl-C while the second trains ends compare (130), not just that run; the
    first run's row stays; --resume runs the second only."""
    out = tmp_path / "ctrl-c"
    args = ("--compression", "none", "fp16", "--bandwidth", "uncapped")
    proc = _start(out, *args)
    _until(lambda: _rows(out) and _processes(str(out), "_fp16_"), proc,
           what="first row and second run in flight")
    text = _stopped(proc, signal.SIGINT, True, 130)
    assert "after 1 of 2 runs" in text, text
    _nothing_left(str(out))
    rows = _rows(out)
    assert [(r["compression"], r["status"]) for r in rows] == [("none", "ok")]
    first_log = os.stat(rows[0]["log"]).st_mtime_ns

    res = subprocess.run(_command(out, *args, "--resume"), cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resuming; 1 of 2 runs already done" in res.stdout, res.stdout
    again = _rows(out)
    assert [(r["compression"], r["status"]) for r in again] == [("none", "ok"), ("fp16", "ok")]
    assert again[0] == rows[0] and os.stat(rows[0]["log"]).st_mtime_ns == first_log
    _nothing_left(str(out))


def _starting(out):
    logs = out / "logs"
    return logs.is_dir() and any(logs.iterdir())  # written just before the launcher starts


def _training(out):
    return len(_processes(str(out), "synthetic_benchmark.py")) >= 2


CASES = {
    # a SIGTERM to compare alone while the first run's launcher (horovodrun) is starting
    "sigterm-while-a-run-starts": (("--bandwidth", "uncapped"), _starting, signal.SIGTERM, False),
    # Ctrl-C under the simulated nodes' launcher, its workers training in sessions of their
    # own (nodes of two: sync under --nodes is the hierarchical exchange)
    "ctrl-c-simulated-nodes": (("--bandwidth", "uncapped", "--nodes", "2", "--np", "4"), _training,
                               signal.SIGINT, True),
    # SIGTERM to the group under the capped links: namespaces, bridge, veths, tc qdiscs
    "sigterm-capped-nodes": (("--bandwidth", "1gbit", "--nodes", "2", "--np", "4"), _training,
                             signal.SIGTERM, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stop_signal_leaves_nothing_behind(tmp_path, case):
    args, when, sig, to_group = CASES[case]
    if "1gbit" in args and not CAPPED_OK:
        pytest.skip(CAPPED_WHY)
    out = tmp_path / case
    proc = _start(out, "--compression", "none", "fp16", *args)
    _until(lambda: when(out), proc, what=when.__name__.strip("_"))
    text = _stopped(proc, sig, to_group, 128 + sig)
    assert "after 0 of " in text, text
    _nothing_left(str(out))
    assert _rows(out) == []  # no run finished: nothing to keep, nothing written half
    if CAPPED_OK:  # nothing of this compare's in the network either (named with its pid)
        ours = [n for n in netcap.our_namespaces() + netcap.our_links() if netcap._owner(n) == proc.pid]
        assert ours == [], ours
        qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
        devs = [line.split()[line.split().index("dev") + 1].rstrip(":").split("@")[0]
                for line in qdiscs.splitlines() if " dev " in line]
        assert [d for d in devs if netcap._owner(d) == proc.pid] == [], qdiscs
        folders = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
        assert [d for d in folders if netcap._owner(d) == proc.pid] == [], folders


def test_kill_tree_reaches_descendants_in_other_sessions_and_stop_spares_what_is_not_a_process(tmp_path):
    """Without Horovod: a child whose grandchild runs in a session of its own is killed
    with it (killing the child's group alone left such grandchildren running); and
    workers.stop() of something whose pid is 0 (a test's stand-in) signals nothing --
    killpg(0) would be the caller's own group (checked in a session of its own)."""
    from hvd_compress.tools import stopping
    marker = f"{tmp_path}/tree"
    code = ("import subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', '{marker}'],"
            " start_new_session=True)\n"
            "print('ready', flush=True); time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", code, marker], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert len(_processes(marker)) == 2
        killed = stopping.kill_tree([child.pid])
        assert child.wait(timeout=10) == -signal.SIGKILL and len(killed) == 2
        stopping.reap()
        _nothing_left(marker)
    finally:
        for pid in _processes(marker):
            os.kill(pid, signal.SIGKILL)
    spare = ("from hvd_compress.tools import workers\n"
             "class Proc:\n    pid, returncode = 0, 0\n    def poll(self): return None\n"
             "    def wait(self): return 0\n"
             "workers.stop(Proc()); print('still here', flush=True)\n")
    res = subprocess.run([sys.executable, "-c", spare], cwd=REPO, capture_output=True, text=True,
                         timeout=60, start_new_session=True)
    assert res.returncode == 0 and "still here" in res.stdout, res.stdout + res.stderr
