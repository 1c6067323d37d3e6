"""The comparison over worker counts: capped links, the end-to-end matrix, its plan and
launches (the cost model: test_predict.py; the results: test_report.py)."""

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_compress.tools import netcap
from tests.harness import REPO
from tests.test_report import made_up_row

CAPPED_OK, CAPPED_WHY = netcap.available()
needs_capped = pytest.mark.skipif(not CAPPED_OK, reason=CAPPED_WHY or "capped links available")


def test_bandwidth_and_latency_parsing():
    assert netcap.parse_rate("100mbit") == 1e8 and netcap.parse_rate("1Gbit") == 1e9
    assert netcap.parse_rate("2.5gbit") == 2.5e9 and netcap.format_rate(1e9) == "1gbit"
    assert netcap.parse_latency("200us") == pytest.approx(2e-4) and netcap.parse_latency("2") == 0.002
    for bad in ("fast", "-1gbit", "0mbit"):
        with pytest.raises(ValueError):
            netcap.parse_rate(bad)


# -- capped links ----------------------------------------------------------------------------
def _transfer_seconds(net, nbytes: int) -> float:
    server = subprocess.Popen(net.exec_prefix(0) + [sys.executable, "-c", f"""
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('{net.address(0)}', 5999)); s.listen(1); print('ready', flush=True)
c, _ = s.accept(); got = 0; t0 = None
while got < {nbytes}:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    got += len(b)
print(got, time.perf_counter() - t0, flush=True)
"""], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    subprocess.run(net.exec_prefix(1) + [sys.executable, "-c", f"""
import socket
s = socket.create_connection(('{net.address(0)}', 5999)); s.sendall(b'x' * {nbytes}); s.close()
"""], check=True, timeout=60)
    got, seconds = server.communicate(timeout=60)[0].split()
    assert int(got) == nbytes
    return float(seconds)


def _leftovers():
    return netcap.our_namespaces() + netcap.our_links()


@needs_capped
def test_capped_link_moves_data_at_the_set_rate_and_cleans_up():
    nbytes = 6_250_000  # 0.5 s at 100 Mbit/s
    with netcap.CappedNetwork(2, netcap.parse_rate("100mbit")) as net:
        assert set(net.namespaces) <= set(netcap.our_namespaces())
        qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", net.veths[0]], capture_output=True,
                                text=True).stdout
        assert "tbf" in qdiscs
        seconds = _transfer_seconds(net, nbytes)
    ideal = nbytes * 8 / 100e6
    # never faster than the cap; slower by up to 1.6x where the cores are busy (seen: 1.51x
    # with the suite's launches beside it) -- a rate off by 2x, or bytes for bits, still fails
    assert 0.8 * ideal <= seconds <= 1.6 * ideal, (seconds, ideal)
    assert _leftovers() == []
    assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in net.namespaces)


@needs_capped
def test_capped_network_is_removed_when_interrupted(tmp_path):
    code = ("import time; from hvd_compress.tools import netcap\n"
            "with netcap.CappedNetwork(2, 1e8) as net:\n"
            "    print(' '.join(net.namespaces), flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    names = proc.stdout.readline().split()
    assert len(names) == 2 and set(names) <= set(netcap.our_namespaces())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not set(names) & set(netcap.our_namespaces())
    assert _leftovers() == []


# -- the matrix, end to end ---------------------------------------------------------------------
# digits: two epochs, two points on each accuracy curve; batches of 32 (half the default's
# steps: training is most of a run's time; none still reaches TARGET at np 1)
BATCH = 32
TINY = f"--epochs 2 --min-numel 0 --batch-size {BATCH}"
TARGET = 0.5


def _compare(out, *args, timeout=900):
    cmd = [sys.executable, str(REPO / "scripts" / "compare.py"), "--out", str(out), "--quiet", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return res


def _rows(out):
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def _check_targets(rows, target):
    """Each successful row's target columns agree with its curve: the first point at or
    above the target, else blanks.  Returns the rows that reached it."""
    reached = []
    for r in rows:
        curve = json.loads(r["curve"])
        first = next((p for p in curve if p["test_accuracy"] >= target), None)
        assert float(r["target_accuracy"]) == target, r
        assert float(r["best_accuracy"]) == max(p["test_accuracy"] for p in curve), r
        if first is None:
            assert r["time_to_target_s"] == r["epochs_to_target"] == "", r
        else:
            assert float(r["time_to_target_s"]) == first["seconds"], r
            assert int(r["epochs_to_target"]) == first["epoch"], r
            reached.append(r)
    return reached


@pytest.mark.multiprocess
def test_tiny_matrix_end_to_end_with_a_target_a_mode_a_failed_run_and_resume(tmp_path):
    """Eight launches, as before modes and targets: a matrix of 6 sync runs with a target,
    then a resume that adds two mode runs, one of which fails."""
    bands = ["uncapped", "1gbit"] if CAPPED_OK else ["uncapped"]
    specs = ("none", "topk:ratio=0.01")
    res = _compare(tmp_path, "--example", "digits", "--compression", *specs, "--np", "1", "2",
                   "--bandwidth", *bands, "--target-accuracy", str(TARGET), "--example-args", TINY,
                   "--predict")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _rows(tmp_path)
    expected = {(c, "sync", n, b) for c in specs for n in ("1", "2") for b in bands
                if n == "2" or b == "uncapped"}
    assert {compare_key(r) for r in rows} == expected
    for r in rows:
        assert r["status"] == "ok", r
        assert r["framework"] == "torch" and r["example"] == "digits"
        assert float(r["images_per_sec"]) > 0 and float(r["step_ms"]) > 0
        assert os.path.exists(r["log"])
        _check_curve(r)
    reached = _check_targets(rows, TARGET)  # (seen here: 0.69 at np 1 for none)
    assert any(r["compression"] == "none" and r["np"] == "1" for r in reached), rows

    def row(spec, mode="sync", np_="2", bw="uncapped"):
        return next(r for r in rows if compare_key(r) == (spec, mode, np_, bw))
    assert int(row("topk:ratio=0.01")["bytes_per_step"]) < int(row("none")["bytes_per_step"]) / 10
    md = (tmp_path / "results.md").read_text()
    assert md.count("\n| torch |") == len(rows) and "vs none" in md and "1.00x" in md
    assert "| mode |" not in md and "| to target s | epochs to target |" in md
    for setting in {(r["np"], r["bandwidth"]) for r in reached}:  # the fastest to the target, named
        here = [r for r in reached if (r["np"], r["bandwidth"]) == setting]
        best = min(here, key=lambda r: float(r["time_to_target_s"]))
        assert f"fastest to {TARGET:g} at np {setting[0]}, {setting[1]}: {best['compression']} -- " in md, md
    for png in ("throughput.png", "bytes_per_step.png", "time_split.png", "accuracy_vs_time.png",
                "accuracy_curves.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pred = (tmp_path / "prediction.md").read_text()
    assert "Crossover" in pred and "1024" in pred
    if CAPPED_OK:
        assert "Fitted to 4 run(s) with more than one worker (2 capped)" in pred
        assert "Alpha is fixed at 50 us" in pred and "offsets" in pred
        assert "leave one out" in pred and "within 25%" in pred
    before = {compare_key(r): r["wall_s"] for r in rows}

    # --resume with modes: the sync runs are done, local SGD H=2 and DGA D=1 are not (rows are
    # keyed by mode); DGA fails (the extra flag --backward-passes-per-step 2 is one DGA refuses,
    # local SGD's own period overrides it) and is recorded, not dropped; the target columns
    # follow the new target (1.0: every run misses it unless it scored every test image)
    res = _compare(tmp_path, "--example", "digits", "--compression", "none", "--np", "2",
                   "--bandwidth", "uncapped", "--local-sgd", "2", "--delay", "1", "--resume",
                   "--target-accuracy", "1", "--example-args", TINY + " --backward-passes-per-step 2")
    assert "resuming; 1 of 3 runs already done" in res.stdout, res.stdout + res.stderr
    rows = _rows(tmp_path)
    failed = [r for r in rows if r["status"] != "ok"]
    assert [compare_key(r) for r in failed] == [("none", "DGA D=1", "2", "uncapped")]
    for r in failed:
        assert r["status"].startswith("failed") and r["log"] in r["status"]
        assert "needs backward_passes_per_step=1" in open(r["log"]).read()
        assert r["time_to_target_s"] == r["best_accuracy"] == "" and r["curve"] == ""
    assert before == {compare_key(r): r["wall_s"] for r in rows if r["mode"] == "sync"}
    local = row("none", "local SGD H=2")
    assert local["status"] == "ok" and local["example"] == "digits"
    _check_curve(local)
    assert "--local-sgd --backward-passes-per-step 2" in open(local["log"]).read()
    # H=2 averages after every second of the 44 steps: half the bytes of synchronous training
    assert int(local["steps"]) == int(row("none")["steps"]) == 2 * (719 // BATCH)
    assert int(local["bytes_per_step"]) == pytest.approx(int(row("none")["bytes_per_step"]) / 2, abs=1)
    ok = [r for r in rows if r["status"] == "ok"]
    reached = _check_targets(ok, 1.0)
    missed = [r for r in ok if r not in reached]
    md = (tmp_path / "results.md").read_text()
    assert "failed" in md and md.count("missed (best ") == len(missed) > 0
    assert "| mode |" in md and "| local SGD H=2 |" in md and "| DGA D=1 |" in md
    speedup = float(local["images_per_sec"]) / float(row("none")["images_per_sec"])  # against none sync
    line = next(x for x in md.splitlines() if "| local SGD H=2 |" in x)
    assert f"| {float(local['images_per_sec']):.1f} |" in line and f"| {speedup:.2f}x |" in line


def _check_curve(r):
    """One point per epoch, in training seconds (the clock of images/s)."""
    curve = json.loads(r["curve"])
    assert [p["epoch"] for p in curve] == [1, 2], r
    assert 0 < curve[0]["seconds"] < curve[1]["seconds"], r
    assert curve[-1]["test_accuracy"] == float(r["test_accuracy"]), r
    images = int(r["steps"]) * BATCH * int(r["np"])  # one backward pass per step
    assert curve[-1]["seconds"] == pytest.approx(images / float(r["images_per_sec"]), rel=0.02), r


def compare_key(row):
    return (row["compression"], row["mode"], row["np"], row["bandwidth"])


def test_compare_help_and_bad_input():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "compare.py"), "--help"],
                         capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0 and "--bandwidth" in res.stdout and "--predict" in res.stdout
    for bad, msg in ((["--bandwidth", "fast"], "bandwidth"), (["--compression", "topk:ratio=2"], "ratio"),
                     (["--example", "cifar10"], "data-dir"), (["--alpha-us", "-1"], "alpha-us")):
        res = subprocess.run([sys.executable, str(REPO / "scripts" / "compare.py"), "--out", "/tmp/x", *bad],
                             capture_output=True, text=True, cwd=REPO)
        assert res.returncode == 2 and msg in res.stderr, res.stderr


def test_a_rate_without_its_unit_is_refused_with_the_forms_accepted(tmp_path):
    """tc would take ``--bandwidth 5`` as 5 bit/s and every capped run would fail there:
    refused at parsing (status 2, nothing launched, no out dir), the forms listed."""
    for bad in (["--bandwidth", "uncapped", "5"], ["--bandwidth", "1e9"], ["--local-bandwidth", "200"]):
        out = tmp_path / "never"
        res = subprocess.run([sys.executable, str(REPO / "scripts" / "compare.py"), "--out", str(out),
                              *bad], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert res.returncode == 2, res.stderr
        assert f"{bad[-1]!r} has no unit" in res.stderr and "100mbit, 1gbit, 10gbit" in res.stderr, res.stderr
        assert "gbit/s" in res.stderr and not out.exists()
        assert ("'uncapped'" in res.stderr) == (bad[0] == "--bandwidth"), res.stderr
    from hvd_compress.tools import compare
    args = compare.parser().parse_args(["--out", "x", "--bandwidth", "none", "1Gbit", "100mbit/s", "2.5g"])
    assert args.bandwidth == ["uncapped", "1gbit", "100mbit", "2.5gbit"]


def _lay_out_examples(folder):
    from hvd_compress.tools import compare
    folder.mkdir(parents=True)
    for script in compare.EXAMPLES.values():
        (folder / script).write_text("")
    return folder


def test_examples_are_found_in_the_checkout_then_in_the_installed_package(tmp_path):
    from hvd_compress.tools import compare
    for framework, folder in compare.FRAMEWORK_DIRS.items():
        assert compare.examples_dir(framework) == REPO / folder
    # a folder laid out like an installed package: <site>/hvd_compress/tools/examples/<folder>/
    tools = tmp_path / "site" / "hvd_compress" / "tools"
    tools.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="cannot find the torch example scripts") as err:
        compare.examples_dir("torch", tools)
    assert str(tools / "examples" / "torch_examples") in str(err.value)
    packaged = {fw: _lay_out_examples(tools / "examples" / folder)
                for fw, folder in compare.FRAMEWORK_DIRS.items()}
    for framework in compare.FRAMEWORK_DIRS:
        assert compare.examples_dir(framework, tools) == packaged[framework]
    # a stray, incomplete folder beside the package does not hide the packaged copy...
    (tmp_path / "site" / "torch_examples").mkdir()
    (tmp_path / "site" / "torch_examples" / "train_digits.py").write_text("")
    assert compare.examples_dir("torch", tools) == packaged["torch"]
    # ...and a checkout's complete one comes first
    checkout = _lay_out_examples(tmp_path / "site" / "tf_examples")
    assert compare.examples_dir("tensorflow", tools) == checkout


def test_compare_says_so_when_no_examples_can_be_found(monkeypatch, tmp_path, capsys):
    from hvd_compress.tools import compare, run
    monkeypatch.setattr(run, "TOOLS_DIR", tmp_path / "site" / "hvd_compress" / "tools")
    with pytest.raises(SystemExit) as stop:
        compare.main(["--out", str(tmp_path / "out"), "--compression", "none", "--np", "1", "--quiet"])
    assert stop.value.code == 2
    assert "cannot find the torch example scripts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_build_ships_the_examples_where_compare_looks(tmp_path):
    """setup.py's build step copies torch_examples/ and tf_examples/ into the package;
    from that tree (no checkout around it) compare finds the copies."""
    from hvd_compress.tools import compare
    lib = tmp_path / "lib"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=REPO,
                   check=True, capture_output=True)
    tools = lib / "hvd_compress" / "tools"
    assert (tools / "compare.py").is_file()
    for framework, folder in compare.FRAMEWORK_DIRS.items():
        found = compare.examples_dir(framework, tools)
        assert found == tools / "examples" / folder
        sources = sorted(p.name for p in (REPO / folder).glob("*.py"))
        assert sorted(p.name for p in found.glob("*.py")) == sources
        for name in sources:
            assert (found / name).read_bytes() == (REPO / folder / name).read_bytes()


def test_uncapped_fallback_message_without_root(monkeypatch, tmp_path):
    from hvd_compress.tools import compare
    monkeypatch.setattr(netcap, "available", lambda: (False, "capped links need root"))
    monkeypatch.setattr(compare, "execute", lambda args, run, out: dict(
        run, status="ok", images_per_sec=1.0, step_ms=1.0, log="x"))
    t0 = time.time()
    assert compare.main(["--out", str(tmp_path), "--compression", "none", "--np", "2",
                         "--bandwidth", "1gbit", "--quiet"]) == 0
    assert time.time() - t0 < 60
    assert [r["bandwidth"] for r in _rows(tmp_path)] == ["uncapped"]


def test_per_tensor_flags_reach_every_run_and_mappings_are_accepted():
    from hvd_compress.tools import compare as cmp
    from hvd_compress.tools import predict as predictions
    args = cmp.parser().parse_args(["--out", "x", "--compression", "none", "*fc*=topk;*=fp16",
                                    "--min-numel", "0", "--start-step", "5"])
    run = {"framework": "torch", "example": "digits", "compression": args.compression[1]}
    cmd = cmp.example_command(args, run, Path("r.json"))
    assert cmd[cmd.index("--min-numel") + 1] == "0" and cmd[cmd.index("--start-step") + 1] == "5"
    assert cmd[cmd.index("--compression") + 1] == "*fc*=topk;*=fp16"
    assert "--min-numel" not in cmp.example_command(cmp.parser().parse_args(["--out", "x"]),
                                                    run, Path("r.json"))
    assert predictions._collective("*fc*=topk;*=fp16") == "allgather"
    assert predictions._collective("*fc*=randomk;*=fp16") == "allreduce"
    assert predictions._messages("*=powersgd") == 2.0


def test_modes_are_rows_of_the_matrix_with_their_example_flags():
    from hvd_compress.tools import compare as cmp
    args = cmp.parser().parse_args(["--out", "x", "--example", "digits", "--compression", "none", "fp16",
                                    "--np", "1", "2", "--bandwidth", "uncapped", "1gbit",
                                    "--local-sgd", "4", "--delay", "0", "2"])
    assert cmp.run_modes(args.local_sgd, args.delay) == ["sync", "DGA D=2", "local SGD H=4"]
    runs = cmp.plan_runs(args, capped_ok=True)
    got = [(r["compression"], r["mode"], r["np"], r["bandwidth"]) for r in runs]
    assert got[:5] == [("none", "sync", 1, "uncapped"), ("none", "sync", 2, "uncapped"),
                       ("none", "sync", 2, "1gbit"), ("none", "DGA D=2", 2, "uncapped"),
                       ("none", "DGA D=2", 2, "1gbit")]
    assert len(runs) == 2 * (1 + 3 * 2)  # per compressor: np 1 once (sync), np 2 per mode x bandwidth
    flags = {r["mode"]: cmp.example_command(args, r, Path("r.json")) for r in runs}
    assert "--local-sgd" not in flags["sync"] and "--delay" not in flags["sync"]
    lsgd = flags["local SGD H=4"]
    at = lsgd.index("--local-sgd")
    assert lsgd[at + 1:at + 3] == ["--backward-passes-per-step", "4"]
    assert flags["DGA D=2"][flags["DGA D=2"].index("--delay") + 1] == "2"
    names = {cmp.run_name(r) for r in runs}
    assert len(names) == len(runs) and "torch_digits_none_np2_uncapped" in names  # sync: as before
    assert "torch_digits_none_local_SGD_H_4_np2_1gbit" in names
    keys = {cmp.run_key(r) for r in runs}
    assert len(keys) == len(runs)
    old = {k: v for k, v in runs[1].items() if k != "mode"}  # a row from before modes: sync
    assert cmp.run_key(old) == cmp.run_key(runs[1])
    with pytest.raises(ValueError, match="unknown mode"):
        cmp.mode_flags("local SGD every 4")
    with pytest.raises(ValueError, match="one-round compressor"):
        cmp.check_modes(["none", "powersgd:rank=2"], ["sync", "DGA D=2"])
    cmp.check_modes(["powersgd:rank=2"], ["sync", "local SGD H=4"])


def test_modes_for_some_specs_and_runs_that_stop_at_the_target(tmp_path):
    """Issue 19's documented job: local SGD for ``none`` only (--modes-for), and every run
    told to stop at the target (--stop-at-target passes the examples' --stop-at A)."""
    from hvd_compress.tools import compare as cmp
    args = cmp.parser().parse_args(["--out", "x", "--framework", "tensorflow", "--example", "digits",
                                    "--compression", "none", "topk:ratio=0.01", "powersgd:rank=2",
                                    "--np", "1", "2", "--bandwidth", "uncapped", "1gbit",
                                    "--local-sgd", "4", "--delay", "2", "--modes-for", "none",
                                    "--strategy", "mwms", "--target-accuracy", "0.85",
                                    "--stop-at-target"])
    runs = cmp.plan_runs(args, capped_ok=True)
    modes = {}
    for r in runs:
        modes.setdefault(r["mode"], set()).add(r["compression"])
    assert modes == {"sync": {"none", "topk:ratio=0.01", "powersgd:rank=2"},
                     "DGA D=2": {"none"}, "local SGD H=4": {"none"}, "TF MWMS": {"none"}}
    assert len(runs) == 3 * 3 + 2 * 2 + 3  # sync: np 1 + np 2 x 2 bandwidths; the modes at np 2
    for r in runs:
        cmd = cmp.example_command(args, r, Path("r.json"))
        assert cmd[cmd.index("--stop-at") + 1] == "0.85", cmd
    # DGA refuses PowerSGD, but --modes-for keeps it out of that mode: no usage error
    cmp.check_modes(args.modes_for, cmp.run_modes(args.local_sgd, args.delay, args.strategy))
    plain = cmp.parser().parse_args(["--out", "x", "--example", "digits", "--target-accuracy", "0.85"])
    assert all("--stop-at" not in cmp.example_command(plain, r, Path("r.json"))
               for r in cmp.plan_runs(plain, capped_ok=True))
    # with --framework torch the MWMS rows run TensorFlow's example and are compared with
    # the torch runs of their setting (speed-up over torch's none, the fastest to the target)
    args = cmp.parser().parse_args(["--out", "x", "--example", "digits-wide", "--compression", "none",
                                    "--np", "2", "--bandwidth", "uncapped", "--strategy", "mwms"])
    runs = cmp.plan_runs(args, capped_ok=True)
    assert [(r["framework"], r["mode"]) for r in runs] == [("torch", "sync"), ("tensorflow", "TF MWMS")]
    assert "tf_examples" in cmp.example_command(args, runs[1], Path("r.json"))[1]
    rows = [made_up_row("none", 2, "uncapped", ips=100.0, curve=[(4.0, 0.9)]),
            dict(made_up_row("none", 2, "uncapped", "TF MWMS", ips=150.0, curve=[(2.0, 0.9)]),
                 framework="tensorflow")]
    assert cmp.speedups(rows)[cmp.run_key(rows[1])] == pytest.approx(1.5)
    assert any("none (TF MWMS)" in line and "2.00x sooner than none" in line
               for line in cmp.target_lines(rows, 0.85)), cmp.target_lines(rows, 0.85)
    tf_too = rows + [dict(made_up_row("none", 2, "uncapped", ips=50.0, curve=[(8.0, 0.9)]),
                          framework="tensorflow")]  # a TF Horovod none beside it: MWMS stays with TF
    assert cmp.speedups(tf_too)[cmp.run_key(rows[1])] == pytest.approx(3.0)
    md = tmp_path / "results.md"
    row = made_up_row("none", 2, "uncapped", curve=[(1.0, 0.9)])
    cmp.write_markdown(md, [row], 0.85, stopped=True)
    assert "Every run stopped there (--stop-at-target)" in md.read_text()
    cmp.write_markdown(md, [row], 0.85)
    assert "stopped" not in md.read_text()


def test_mwms_baseline_is_one_uncompressed_row_per_setting_launched_without_horovod(monkeypatch,
                                                                                    tmp_path):
    """Issue 19: --strategy mwms adds TensorFlow's MultiWorkerMirroredStrategy as a row
    (mode TF MWMS, compression none) per worker count and bandwidth, np 1 included; it
    runs the example with --strategy mwms under the mwms launcher, uncapped, or in the
    capped namespaces; the cost model leaves it out (sync rows only)."""
    from hvd_compress.tools import compare as cmp
    args = cmp.parser().parse_args(["--out", str(tmp_path), "--framework", "tensorflow",
                                    "--example", "digits", "--compression", "none", "topk",
                                    "--np", "1", "2", "--bandwidth", "uncapped", "1gbit",
                                    "--strategy", "mwms"])
    runs = cmp.plan_runs(args, capped_ok=True)
    mwms = [(r["compression"], r["np"], r["bandwidth"]) for r in runs if r["mode"] == cmp.MWMS]
    assert mwms == [("none", 1, "uncapped"), ("none", 2, "uncapped"), ("none", 2, "1gbit")]
    assert len(runs) == 2 * 3 + 3
    row = next(r for r in runs if r["mode"] == cmp.MWMS and r["bandwidth"] == "uncapped"
               and r["np"] == 2)
    cmd = cmp.example_command(args, row, Path("r.json"))
    assert cmd[cmd.index("--strategy") + 1] == "mwms" and cmd[cmd.index("--compression") + 1] == "none"
    assert cmp.method(row) == "none (TF MWMS)"
    launched = _record_launches(monkeypatch)
    cmp.execute(args, row, tmp_path)
    assert launched[0][1:5] == ["-m", "hvd_compress.tools.mwms", "-np", "2"]
    capped = []
    monkeypatch.setattr(cmp.netcap, "launch_mwms", lambda net, cmd, **kw: capped.append(cmd) or 0)
    monkeypatch.setattr(cmp.netcap, "CappedNetwork", lambda *a: contextlib.nullcontext(None))
    cmp.execute(args, next(r for r in runs if r["mode"] == cmp.MWMS and r["bandwidth"] == "1gbit"),
                tmp_path)
    assert capped and "--strategy" in capped[0]


def _record_launches(monkeypatch) -> list:
    """What compare's execute() launches from now on: recorded (argv), not run."""
    launched = []

    class Proc:
        pid, returncode = 0, 0

        def __init__(self, argv, **kw):
            launched.append(argv)

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Proc)
    return launched


def test_nodes_run_hierarchical_and_flat_side_by_side(monkeypatch, tmp_path):
    """Issue 17: --nodes 2 runs each gathering compressor in mode sync (hierarchical) and
    flat, summable ones once; uncapped under nodesrun, capped with one namespace of np/2
    workers per node -- and without --nodes, one namespace per worker, as before."""
    from hvd_compress.tools import compare as cmp
    args = cmp.parser().parse_args(["--out", str(tmp_path), "--compression", "none", "topk:ratio=0.01",
                                    "--np", "1", "4", "--nodes", "2", "--bandwidth", "uncapped", "1gbit"])
    runs = cmp.plan_runs(args, capped_ok=True)
    got = {(r["compression"], r["mode"], r["np"], r["nodes"], r["bandwidth"]) for r in runs}
    assert got == {("none", "sync", 1, 1, "uncapped"), ("none", "sync", 4, 2, "uncapped"),
                   ("none", "sync", 4, 2, "1gbit"), ("topk:ratio=0.01", "sync", 1, 1, "uncapped"),
                   ("topk:ratio=0.01", "sync", 4, 2, "uncapped"), ("topk:ratio=0.01", "sync", 4, 2, "1gbit"),
                   ("topk:ratio=0.01", "flat", 4, 2, "uncapped"), ("topk:ratio=0.01", "flat", 4, 2, "1gbit")}
    assert len({cmp.run_name(r) for r in runs}) == len({cmp.run_key(r) for r in runs}) == len(runs)
    # integer sums take the hierarchy too: both ways; other summable specs once
    assert [cmp.takes_hierarchy(s) for s in ("terngrad:sum=int", "terngrad", "fp16", "randomk:ratio=0.1",
                                             "*fc*=qsgd:sum=int;*=none")] == [True, True, False, False, True]
    flat = next(r for r in runs if r["mode"] == "flat" and r["bandwidth"] == "uncapped")
    cmd = cmp.example_command(args, flat, Path("r.json"))
    assert cmd[cmd.index("--exchange") + 1] == "allgather"
    sync = next(r for r in runs if r["mode"] == "sync" and r["np"] == 4 and r["bandwidth"] == "uncapped")
    hier = cmp.example_command(args, sync, Path("r.json"))
    assert hier[hier.index("--exchange") + 1] == "hierarchical"
    assert cmp.method(flat) == "topk:ratio=0.01 (flat)"
    assert cmp.run_key({k: v for k, v in runs[0].items() if k != "nodes"}) == cmp.run_key(runs[0])
    launched, capped = _record_launches(monkeypatch), []
    cmp.execute(args, flat, tmp_path)
    assert launched[0][1:7] == ["-m", "hvd_compress.tools.nodesrun", "--nodes", "2", "-np", "4"]
    nets = []
    monkeypatch.setattr(cmp.netcap, "CappedNetwork",
                        lambda n, *a: nets.append(n) or contextlib.nullcontext(None))
    monkeypatch.setattr(cmp.netcap, "launch_horovod",
                        lambda net, cmd, **kw: capped.append(kw["per_node"]) or 0)
    cmp.execute(args, next(r for r in runs if r["mode"] == "flat" and r["bandwidth"] == "1gbit"),
                tmp_path)
    one = dict(flat, nodes=1, np=2, bandwidth="1gbit", mode="sync")
    cmp.execute(args, one, tmp_path)
    assert nets == [2, 2] and capped == [2, 1]  # 2 nodes of 2; then 2 namespaces of 1


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "mwms"], "--strategy mwms runs with --example digits or digits-wide"),
    (["--framework", "tensorflow", "--strategy", "mwms"], "--example digits or digits-wide"),
    (["--example", "digits", "--target-accuracy", "0"], "(0, 1]"),
    (["--example", "digits", "--target-accuracy", "1.5"], "(0, 1]"),
    (["--example", "digits", "--target-accuracy", "nan"], "(0, 1]"),
    (["--target-accuracy", "0.9"], "synthetic benchmark has none"),
    (["--compression", "powersgd:rank=2", "--delay", "2"], "one-round compressor"),
    (["--local-sgd", "0"], "must be >= 1"),
    (["--delay", "-1"], "must be >= 0"),
    (["--np", "3", "--nodes", "2"], "multiples of --nodes 2"),
    (["--example", "digits", "--stop-at-target"], "--stop-at-target needs --target-accuracy"),
    (["--compression", "none", "--modes-for", "none"], "--modes-for needs --local-sgd or --delay"),
    (["--compression", "none", "--local-sgd", "4", "--modes-for", "topk"],
     "--modes-for names specs that --compression does not: topk"),
    (["--compression", "none", "powersgd:rank=2", "--delay", "2", "--modes-for", "powersgd:rank=2"],
     "one-round compressor"),
])
def test_bad_target_and_mode_input_is_a_usage_error(flags, message, tmp_path, capsys):
    from hvd_compress.tools import compare
    with pytest.raises(SystemExit) as stop:
        compare.main(["--out", str(tmp_path / "out"), "--quiet", *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_resume_keys_rows_by_mode(monkeypatch, tmp_path):
    from hvd_compress.tools import compare
    launched = []

    def fake(args, run, out):
        launched.append((run["compression"], run["mode"], run["np"]))
        return dict(run, status="ok", images_per_sec=1.0, step_ms=1.0, log="x", steps=1,
                    curve=json.dumps([{"epoch": 1, "seconds": 1.0, "test_accuracy": 0.9}]))
    monkeypatch.setattr(compare, "execute", fake)
    base = ["--out", str(tmp_path), "--example", "digits", "--compression", "none", "--np", "2",
            "--bandwidth", "uncapped", "--quiet"]
    assert compare.main(base) == 0 and launched == [("none", "sync", 2)]
    # results written before modes existed have no mode column: their rows are sync
    rows = _rows(tmp_path)
    with open(tmp_path / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c for c in compare.COLUMNS if c != "mode"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    launched.clear()
    assert compare.main(base + ["--local-sgd", "4", "--delay", "2", "--resume", "--target-accuracy",
                                "0.85"]) == 0
    assert launched == [("none", "DGA D=2", 2), ("none", "local SGD H=4", 2)]
    rows = _rows(tmp_path)
    assert [r["mode"] for r in rows] == ["sync", "DGA D=2", "local SGD H=4"]
    assert [r["time_to_target_s"] for r in rows] == ["1.0"] * 3  # the kept row too, for the new target
    launched.clear()
    assert compare.main(base + ["--local-sgd", "4", "--resume"]) == 0 and launched == []


def test_examples_accept_the_mapping_form_and_check_each_of_its_specs(capsys):
    """The examples' parser takes 'pattern=spec;...' as compare passes it (each rule's spec is
    checked against --local-sgd/--delay), not only a single spec."""
    from hvd_compress.tools import runtools
    ap = runtools.common_parser("x", epochs=1)
    args = ap.parse_args(["--compression", "*fc*=topk:ratio=0.01;*=fp16", "--delay", "2"])
    assert args.compression == "*fc*=topk:ratio=0.01;*=fp16" and args.delay == 2
    with pytest.raises(SystemExit) as stop:
        ap.parse_args(["--compression", "*fc*=powersgd:rank=2;*=none", "--delay", "2"])
    assert stop.value.code == 2 and "one-round compressor" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ap.parse_args(["--compression", "powersgd:rank=2", "--delay", "1"])


def test_runs_wait_for_gloo_longer_than_its_default(monkeypatch, tmp_path):
    """Every run inherits HOROVOD_GLOO_TIMEOUT_SECONDS=120 unless it is set (Gloo's 30 s
    aborted runs whose ranks waited on one rank's first kernel compiles)."""
    from hvd_compress.tools import compare
    key, seen = "HOROVOD_GLOO_TIMEOUT_SECONDS", []
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != key})

    def fake(args, run, out):
        seen.append(os.environ.get(key))
        return dict(run, status="ok", images_per_sec=1.0, step_ms=1.0, log="x", steps=1)
    monkeypatch.setattr(compare, "execute", fake)
    base = ["--compression", "none", "--np", "1", "--bandwidth", "uncapped", "--quiet"]
    assert compare.main(["--out", str(tmp_path / "a"), *base]) == 0 and seen == ["120"]
    os.environ[key] = "45"  # the user's own stays
    assert compare.main(["--out", str(tmp_path / "b"), *base]) == 0 and seen == ["120", "45"]
