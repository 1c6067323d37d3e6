"""The comparison over worker counts: cost model, capped links, the end-to-end matrix."""

import csv
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hvd_compress.tools import costmodel, netcap
from hvd_compress.tools.costmodel import ALLGATHER, ALLREDUCE, Link, Sample
from tests.harness import REPO

CAPPED_OK, CAPPED_WHY = netcap.available()
needs_capped = pytest.mark.skipif(not CAPPED_OK, reason=CAPPED_WHY or "capped links available")


# -- cost model ------------------------------------------------------------------------------
def test_wire_bytes_and_hops_of_ring_collectives():
    assert costmodel.wire_bytes(ALLREDUCE, 2, 100.0) == 100.0  # 2(p-1)/p * S
    assert costmodel.wire_bytes(ALLREDUCE, 4, 100.0) == 150.0
    assert costmodel.wire_bytes(ALLGATHER, 4, 100.0) == 300.0  # (p-1) * S
    assert costmodel.wire_bytes(ALLREDUCE, 1, 100.0) == 0.0
    assert (costmodel.hops(ALLREDUCE, 8), costmodel.hops(ALLGATHER, 8)) == (14, 7)


OFFSETS = {"big": 0.120, "small": 0.004, "hidden": -0.030}   # seconds
NBYTES = {"big": 1e8, "small": 1e6, "hidden": 2e6}


def _synthetic_samples(links, rng, noise=0.0, ps=(2, 4, 8)):
    """Waits from the model itself: max(0, offset + alpha-beta transfer), uncapped runs
    included (infinite rate), 1 s of other work per step."""
    samples = []
    for coll in (ALLREDUCE, ALLGATHER):
        for group, offset in OFFSETS.items():
            for p in ps:
                for bw in (1e8, 1e9, 1e10, math.inf):
                    t = max(0.0, offset + links[coll].comm_s(coll, p, NBYTES[group], bw, 1.0))
                    t *= 1 + noise * rng.standard_normal()
                    samples.append(Sample(coll, p, NBYTES[group], bw, 1.0, t, f"{coll}-{group}", 1.0 + t))
    return samples


def test_fit_model_recovers_known_alpha_beta_and_offsets():
    truth = {ALLREDUCE: Link(alpha_s=37e-6, efficiency=0.83), ALLGATHER: Link(2e-3, 1.3)}
    links, offsets = costmodel.fit_model(_synthetic_samples(truth, np.random.default_rng(0)))
    for coll in truth:
        assert links[coll].alpha_s == pytest.approx(truth[coll].alpha_s, rel=0.02), coll
        assert links[coll].efficiency == pytest.approx(truth[coll].efficiency, rel=0.005), coll
        for group, off in OFFSETS.items():
            if off > 0:  # a hidden transfer's offset is known only where it shows
                assert offsets[f"{coll}-{group}"] == pytest.approx(off, abs=5e-4), (coll, group)
            else:
                assert offsets[f"{coll}-{group}"] < 0
    # with 2% multiplicative noise: still close
    noisy, _ = costmodel.fit_model(_synthetic_samples(truth, np.random.default_rng(1), noise=0.02))
    assert noisy[ALLGATHER].alpha_s == pytest.approx(2e-3, rel=0.15)
    assert noisy[ALLREDUCE].efficiency == pytest.approx(0.83, rel=0.03)
    # one worker count: alpha is given, the link rate still comes out
    fixed, _ = costmodel.fit_model(_synthetic_samples(truth, np.random.default_rng(0), ps=(2,)),
                                   alpha_s=37e-6)
    assert fixed[ALLREDUCE].alpha_s == 37e-6
    assert fixed[ALLREDUCE].efficiency == pytest.approx(0.83, rel=0.005)


def test_fit_model_needs_multi_worker_samples():
    with pytest.raises(ValueError, match="more than one worker"):
        costmodel.fit_model([Sample(ALLREDUCE, 1, 1e6, 1e9, 1, 0.0)])


def test_crossover_matches_the_closed_form():
    link = Link(alpha_s=0.0, efficiency=1.0)
    prof = dict(compute_ms=100.0, images_per_step=32, measured_p=2)
    model = costmodel.StepModel(link, {
        "none": costmodel.Profile("none", ALLREDUCE, encode_ms=0, decode_ms=0, nbytes=1e8, **prof),
        "c": costmodel.Profile("c", ALLGATHER, encode_ms=30, decode_ms=10, nbytes=1e6, **prof)})
    p = 4
    # none: 2(p-1)/p*1e8*8/B s; c: 40 ms + decode grows to 20 ms at p=4, + (p-1)*1e6*8/B s
    extra_s = (30 + 10 * p / 2) / 1e3
    b_star = (2 * (p - 1) / p * 1e8 * 8 - (p - 1) * 1e6 * 8) / extra_s
    kind, bps = costmodel.crossover(model, "c", p)
    assert kind == "below" and bps == pytest.approx(b_star, rel=1e-6)
    assert model.step_ms("c", p, b_star / 2) < model.step_ms("none", p, b_star / 2)
    step_s = 0.1 + 2 * (p - 1) / p * 1e8 * 8 / 1e12
    assert model.images_per_sec("none", p, 1e12) == pytest.approx(p * 32 / step_s, rel=1e-9)


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
    assert abs(seconds - ideal) <= 0.2 * ideal, (seconds, ideal)
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
TINY = ("--width 8 --blocks 1 --num-classes 10 --image-size 8 --batch-size 4 "
        "--num-warmup-batches 1 --num-iters 1 --num-batches-per-iter 2 --min-numel 0")


def _compare(out, *args, timeout=900):
    cmd = [sys.executable, str(REPO / "scripts" / "compare.py"), "--out", str(out), "--quiet", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return res


def _rows(out):
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.multiprocess
def test_tiny_matrix_end_to_end_with_a_failed_run_and_resume(tmp_path):
    bands = ["uncapped", "1gbit"] if CAPPED_OK else ["uncapped"]
    res = _compare(tmp_path, "--compression", "none", "topk:ratio=0.01", "--np", "1", "2",
                   "--bandwidth", *bands, "--example-args", TINY, "--predict")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _rows(tmp_path)
    expected = {(c, n, b) for c in ("none", "topk:ratio=0.01") for n in ("1", "2") for b in bands
                if n == "2" or b == "uncapped"}
    assert {(r["compression"], r["np"], r["bandwidth"]) for r in rows} == expected
    for r in rows:
        assert r["status"] == "ok", r
        assert r["framework"] == "torch" and r["example"] == "synthetic"
        assert float(r["images_per_sec"]) > 0 and float(r["step_ms"]) > 0
        assert os.path.exists(r["log"])
    topk2 = next(r for r in rows if r["compression"] == "topk:ratio=0.01" and r["np"] == "2")
    none2 = next(r for r in rows if r["compression"] == "none" and r["np"] == "2")
    assert int(topk2["bytes_per_step"]) < int(none2["bytes_per_step"]) / 10
    md = (tmp_path / "results.md").read_text()
    assert md.count("\n| torch |") == len(rows) and "vs none" in md and "1.00x" in md
    for png in ("throughput.png", "bytes_per_step.png", "time_split.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pred = (tmp_path / "prediction.md").read_text()
    assert "Crossover" in pred and "1024" in pred
    if CAPPED_OK:
        assert "Fitted to 4 run(s) with more than one worker (2 capped)" in pred
        assert "Alpha is fixed at 50 us" in pred and "offsets" in pred
        assert "leave one out" in pred and "within 25%" in pred
    before = {r["compression"] + r["np"] + r["bandwidth"]: r["wall_s"] for r in rows}

    # --resume: the successful runs stay as they were; a run that fails is recorded, not dropped
    res = _compare(tmp_path, "--compression", "none", "topk:ratio=0.01", "randomk:ratio=0.01",
                   "--np", "1", "2", "--bandwidth", "uncapped", "--resume",
                   "--example-args", TINY + " --blocks 0")  # randomk's runs get a bad flag
    assert "resuming" in res.stdout, res.stdout + res.stderr
    rows = _rows(tmp_path)
    failed = [r for r in rows if r["status"] != "ok"]
    assert {(r["compression"], r["np"]) for r in failed} == {("randomk:ratio=0.01", "1"),
                                                              ("randomk:ratio=0.01", "2")}
    for r in failed:
        assert r["status"].startswith("failed") and r["log"] in r["status"]
        assert "--blocks" in open(r["log"]).read()
    kept = {r["compression"] + r["np"] + r["bandwidth"]: r["wall_s"] for r in rows if r["status"] == "ok"}
    assert {k: before[k] for k in kept} == kept and len(kept) == len(before)
    assert "failed" in (tmp_path / "results.md").read_text()


def test_compare_help_and_bad_input():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "compare.py"), "--help"],
                         capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0 and "--bandwidth" in res.stdout and "--predict" in res.stdout
    for bad, msg in ((["--bandwidth", "fast"], "bandwidth"), (["--compression", "topk:ratio=2"], "ratio"),
                     (["--example", "cifar10"], "data-dir"), (["--alpha-us", "-1"], "alpha-us")):
        res = subprocess.run([sys.executable, str(REPO / "scripts" / "compare.py"), "--out", "/tmp/x", *bad],
                             capture_output=True, text=True, cwd=REPO)
        assert res.returncode == 2 and msg in res.stderr, res.stderr


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
    from hvd_compress.tools import compare
    monkeypatch.setattr(compare, "TOOLS_DIR", tmp_path / "site" / "hvd_compress" / "tools")
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


def test_predict_on_runs_the_model_made_validates_exactly():
    """Rows whose waits come from the model itself: the fit, leave-one-out and the
    across-bandwidth validation must all predict them (nearly) exactly.  (Offsets
    are positive here: a transfer hidden in the uncapped run leaves its offset
    unpinned.)"""
    from hvd_compress.tools import compare
    links = {ALLREDUCE: Link(50e-6, 0.9), ALLGATHER: Link(50e-6, 0.8)}
    specs = {"none": (8e7, 0.150, 0.0), "fp16": (4e7, 0.250, 30.0), "topk:ratio=0.01": (1.6e6, 0.004, 300.0)}
    rows = []
    for spec, (nbytes, offset, codec_ms) in specs.items():
        coll = compare._collective(spec)
        for bw in ("uncapped", "1gbit", "200mbit"):
            rate = math.inf if bw == "uncapped" else netcap.parse_rate(bw)
            wait = max(0.0, offset + links[coll].comm_s(coll, 2, nbytes, rate)) * 1e3
            step = 120.0 + codec_ms + wait
            rows.append({"framework": "torch", "example": "synthetic", "compression": spec, "np": "2",
                         "bandwidth": bw, "latency": "", "status": "ok", "bytes_per_step": str(nbytes),
                         "compute_ms": "120", "encode_ms": str(codec_ms / 2), "decode_ms": str(codec_ms / 2),
                         "comm_ms": str(wait), "step_ms": str(step),
                         "images_per_sec_per_worker": str(8 / (step / 1e3))})
    md, say = compare.predict(rows)
    assert "6/6 within 25%" in say[0] and "worst 0.0%" in say[0], say
    assert any("200mbit runs predicted without any 200mbit run" in line and "3/3" in line for line in say)
    assert "eta = 0.900" in md and "eta = 0.800" in md
    assert "`fp16` +250.0" in md


def test_per_tensor_flags_reach_every_run_and_mappings_are_accepted():
    from hvd_compress.tools import compare as cmp
    args = cmp.parser().parse_args(["--out", "x", "--compression", "none", "*fc*=topk;*=fp16",
                                    "--min-numel", "0", "--start-step", "5"])
    run = {"framework": "torch", "example": "digits", "compression": args.compression[1]}
    cmd = cmp.example_command(args, run, Path("r.json"))
    assert cmd[cmd.index("--min-numel") + 1] == "0" and cmd[cmd.index("--start-step") + 1] == "5"
    assert cmd[cmd.index("--compression") + 1] == "*fc*=topk;*=fp16"
    assert "--min-numel" not in cmp.example_command(cmp.parser().parse_args(["--out", "x"]),
                                                    run, Path("r.json"))
    assert cmp._collective("*fc*=topk;*=fp16") == "allgather"
    assert cmp._collective("*fc*=randomk;*=fp16") == "allreduce"
    assert cmp._messages("*=powersgd") == 2.0
