"""hvd-compress-compare on the user's own hosts (``--hosts h1:4,h2:4``, ``--hostfile``):
the hosts as horovodrun reads them, the layout the ranks take, the refusals, the launch
line, and one real matrix on two local host names (``localhost`` and ``127.0.0.1``:
horovodrun starts both without ssh and Horovod sees two nodes)."""

import csv
import socket
import subprocess
import sys

import pytest

from hvd_compress.tools import compare, hosts
from tests.harness import REPO

TINY = ("--width 4 --blocks 1 --num-classes 10 --image-size 8 --batch-size 2 "
        "--num-warmup-batches 1 --num-iters 1 --num-batches-per-iter 1")
LOCAL2 = "localhost:1,127.0.0.1:1"


def test_hosts_hostfile_and_the_layout_horovodrun_gives_the_ranks(tmp_path):
    assert hosts.parse("h1:4,h2:4") == [("h1", 4), ("h2", 4)]
    assert hosts.parse("h1,h2:2") == [("h1", 1), ("h2", 2)]  # no slots: one, as horovodrun -H
    for bad in ("h1:0", "h1:x", ":4", "h1:2,,h2:2", "h1:2,h1:2"):
        with pytest.raises(ValueError):
            hosts.parse(bad)
    f = tmp_path / "hostfile"
    f.write_text("# the cluster\nh1 slots=4\n\nh2 slots=2  # the small one\nh3\n")
    assert hosts.read_hostfile(str(f)) == "h1:4,h2:2,h3:1"
    f.write_text("h1 gpus=4\n")
    with pytest.raises(ValueError, match="slots=N"):
        hosts.read_hostfile(str(f))
    with pytest.raises(ValueError, match="No such file"):
        hosts.read_hostfile(str(tmp_path / "none"))
    h = hosts.parse("h1:4,h2:4")
    assert hosts.slots(h) == 8
    assert hosts.layout(h, 2) == [("h1", 2)] and hosts.layout(h, 4) == [("h1", 4)]
    assert hosts.layout(h, 6) == [("h1", 4), ("h2", 2)] and hosts.layout(h, 8) == h
    with pytest.raises(ValueError, match="8 slots"):
        hosts.layout(h, 9)
    # horovodrun's own test of a local host: its name resolves to an address of this machine
    for name in ("localhost", "127.0.0.1", socket.gethostname()):
        assert hosts.is_local(name), name
    assert not hosts.is_local("no-such-host.invalid")


@pytest.mark.parametrize("flags, message", [
    (["--bandwidth", "1gbit"], "--bandwidth takes only 'uncapped'"),
    (["--latency", "1ms"], "--latency none"),
    (["--nodes", "2"], "--nodes (simulated nodes on one machine) goes without it"),
    (["--np", "3"], f"--np 3 does not fit the 2 slots of {LOCAL2}"),
    (["--hostfile", "x"], "not allowed with argument --hosts"),
    (["--strategy", "mwms", "--example", "digits"], "--strategy mwms runs on this machine only"),
])
def test_what_real_hosts_cannot_run_is_refused_before_anything_runs(flags, message, tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.setattr(compare, "execute", lambda *a: pytest.fail("launched"))
    with pytest.raises(SystemExit) as exc:
        compare.main(["--out", str(tmp_path / "o"), "--hosts", LOCAL2, *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):  # and the rate between hosts needs hosts
        compare.main(["--out", str(tmp_path / "o"), "--hosts-bandwidth", "10gbit"])
    assert "--hosts-bandwidth is the rate between the hosts" in capsys.readouterr().err


def test_runs_on_hosts_record_their_layout_and_launch_through_horovodrun(tmp_path, monkeypatch, capsys):
    """Without running anything: the planned rows (uncapped, nodes and hosts as horovodrun
    places the ranks), the launch line, and the notes for an uneven layout and a first
    host that is not this machine."""
    launched = []
    monkeypatch.setattr(compare, "execute", lambda args, run, out: launched.append(run) or dict(
        run, status="failed (exit 1)"))
    f = tmp_path / "hostfile"
    f.write_text("remote-a.invalid slots=4\nremote-b.invalid slots=4\n")
    compare.main(["--out", str(tmp_path / "o"), "--hostfile", str(f), "--np", "1", "4", "6", "8",
                  "--compression", "none", "--hosts-bandwidth", "10Gbit", "--quiet"])
    got = [(r["np"], r["nodes"], r["hosts"], r.get("link_bandwidth", ""), r["bandwidth"]) for r in launched]
    assert got == [(1, 1, "remote-a.invalid:1", "", "uncapped"),
                   (4, 1, "remote-a.invalid:4", "", "uncapped"),
                   (6, 2, "remote-a.invalid:4,remote-b.invalid:2", "10gbit", "uncapped"),
                   (8, 2, "remote-a.invalid:4,remote-b.invalid:4", "10gbit", "uncapped")]
    err = capsys.readouterr().err
    assert "np 6 fills the hosts unevenly (remote-a.invalid:4,remote-b.invalid:2)" in err
    assert "rank 0 runs on remote-a.invalid" in err
    with open(tmp_path / "o" / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["hosts"], r["link_bandwidth"]) for r in rows][-1] == (
        "remote-a.invalid:4,remote-b.invalid:4", "10gbit")

    argv = []

    class Proc:  # what execute() starts: recorded, not run
        pid, returncode = 0, 0

        def __init__(self, cmd, **kw):
            argv.append(cmd)

        def poll(self):
            return 0
    monkeypatch.setattr(subprocess, "Popen", Proc)
    from hvd_compress.tools import run as run_mod
    args = compare.parser().parse_args(["--out", "x", "--example-args", TINY])
    run_mod.execute(args, launched[2], tmp_path / "o")
    assert argv[0][1:3] == ["-m", "hvd_compress.tools.hvdrun"]
    assert argv[0][3:9] == ["-np", "6", "-H", "remote-a.invalid:4,remote-b.invalid:2", "--gloo",
                            sys.executable]
    assert "--exchange" not in argv[0]  # real nodes run the default exchange (simulated ones pick)


@pytest.mark.multiprocess
def test_a_matrix_on_two_local_host_names(tmp_path):
    """localhost and 127.0.0.1: two hosts to horovodrun, both started here without ssh
    (Horovod's cross size 2, local size 1).  np 1 takes the first host, np 2 both."""
    out = tmp_path / "hosts"
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "compare.py"), "--out", str(out),
                          "--quiet", "--hosts", LOCAL2, "--np", "1", "2", "--compression", "none",
                          "--hosts-bandwidth", "10gbit", "--example-args", TINY, "--predict"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 0 runs on" not in res.stderr and "unevenly" not in res.stderr
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    got = [(r["np"], r["nodes"], r["hosts"], r["link_bandwidth"], r["bandwidth"], r["status"])
           for r in rows]
    assert got == [("1", "1", "localhost:1", "", "uncapped", "ok"),
                   ("2", "2", LOCAL2, "10gbit", "uncapped", "ok")], res.stdout
    for r in rows:
        assert float(r["images_per_sec"]) > 0 and r["log"]
        assert f"-H {r['hosts']} --gloo" in open(r["log"]).read()
    two = rows[1]
    assert int(two["bytes_per_step"]) > 0  # the two "nodes" exchanged gradients
    assert "| 2 (2 nodes) |" in (out / "results.md").read_text()
    assert (out / "prediction.md").exists()
