"""scripts/bench_kernels.py prints its figures under stable JSON keys: framework, device, numel,
copy_ms, and per compressor compression, encode_ms, decode_ms, payload_bytes, ratio."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_kernels.py"


def run(*args, check=True):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_json_keys_and_ratios():
    doc = json.loads(run("--framework", "numpy", "--numel", "200003", "--repeats", "1",
                         "--json").stdout)
    assert doc["framework"] == "numpy" and doc["numel"] == 200003 and doc["copy_ms"] >= 0
    assert doc["device"] == "cpu"
    by_name = {r["compression"]: r for r in doc["results"]}
    assert set(by_name) == {"none", "fp16", "bf16", "topk", "randomk", "dgc", "qsgd", "terngrad",
                            "onebit", "threshold", "powersgd", "signsgd", "signum", "efsignsgd",
                            "natural", "uniform", "eightbit", "sketchml", "thresholdv", "adaq",
                            "inceptionn"}
    for r in doc["results"]:
        assert set(r) >= {"compression", "encode_ms", "decode_ms", "payload_bytes", "ratio",
                          "floor_copies"}
        assert r["encode_ms"] >= 0 and r["decode_ms"] >= 0
    floor = {name: r["floor_copies"] for name, r in by_name.items()}
    # none moves nothing itself; fp16 reads, writes half, reads half, writes: 1.5 copies;
    # with error feedback 2 copies and the payload's traffic (1-bit: 2 * 1/32 of a copy);
    # an exact top-k reads once more, DGC reads and writes u and v too
    assert floor["none"] == 0.0 and floor["fp16"] == 1.5
    assert floor["onebit"] == round(2.0 + 2 * by_name["onebit"]["payload_bytes"] / (8 * 200003), 3)
    assert floor["topk"] > floor["onebit"] and floor["dgc"] > floor["topk"]
    n = 200003
    assert by_name["none"]["payload_bytes"] == 4 * n
    assert by_name["fp16"]["ratio"] == 2.0
    assert by_name["onebit"]["payload_bytes"] == -(-n // 8) + 8
    assert by_name["terngrad"]["payload_bytes"] == -(-2 * n // 8) + 4
    assert by_name["topk"]["payload_bytes"] == 8 * 2001
    assert by_name["randomk"]["payload_bytes"] == 4 * 2001
    assert by_name["dgc"]["payload_bytes"] == 8 * 201  # past warm-up: 0.1%
    assert by_name["qsgd"]["ratio"] >= 7.8
    assert by_name["signsgd"]["payload_bytes"] == by_name["efsignsgd"]["payload_bytes"] == -(-n // 8) + 4
    assert by_name["natural"]["payload_bytes"] == n + -(-n // 8)
    assert by_name["uniform"]["payload_bytes"] == -(-4 * n // 8) + 8 * -(-n // 512)
    assert by_name["eightbit"]["payload_bytes"] == n + 4
    assert by_name["sketchml"]["payload_bytes"] == n + 4 * 256
    # 1% of each sign: ceil(0.01 n+) + ceil(0.01 n-) indices, n+ + n- = n
    assert 16 + 4 * 2001 <= by_name["adaq"]["payload_bytes"] <= 16 + 4 * 2002
    assert by_name["thresholdv"]["payload_bytes"] % 8 == 4  # the flag, then 8 bytes a value


def test_torch_and_tensorflow_report_the_same_payloads_as_numpy():
    sizes = {}
    for fw in ("numpy", "torch", "tensorflow"):
        doc = json.loads(run("--framework", fw, "--numel", "30011", "--repeats", "1", "--json",
                             "--compression", "topk:ratio=0.01", "--compression", "qsgd",
                             "--compression", "dgc").stdout)
        assert doc["framework"] == fw
        sizes[fw] = [r["payload_bytes"] for r in doc["results"]]
        if fw != "numpy":
            assert doc["results"][0]["framework_topk_ms"] > 0
        assert doc["results"][2]["threshold_ms"] > 0
    assert sizes["numpy"] == sizes["torch"] == sizes["tensorflow"]


def test_human_table_and_selected_compressors():
    out = run("--numel", "5000", "--repeats", "1", "--compression", "topk:ratio=0.1",
              "--compression", "qsgd:levels=16", "--compression", "none").stdout
    assert "copy" in out and "topk:ratio=0.1" in out and "qsgd:levels=16" in out
    assert "/floor" in out and "\nnone " in out  # none's floor is 0: no ratio to it


def test_bad_arguments_are_reported():
    proc = run("--compression", "topk:ratio=3", check=False)
    assert proc.returncode == 2 and "topk: ratio must be in (0, 1], got 3" in proc.stderr
    proc = run("--framework", "jax", check=False)
    assert proc.returncode != 0 and "not available" in proc.stderr
    for args, says in ((("--framework", "numpy", "--device", "cuda"), "with --framework torch"),
                       (("--framework", "torch", "--device", "gpu"), "only cpu, or cuda"),
                       (("--framework", "torch", "--device", "cuda:x"), "only cpu, or cuda")):
        proc = run(*args, check=False)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert run("--help").stdout.startswith("usage:")


def test_torch_on_cuda_reports_the_payloads_of_the_cpu():
    """--device cuda: refused where PyTorch sees no GPU; where it does, the payload sizes
    of the CPU (the bits themselves: tests/test_torch_same_bits.py)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        proc = run("--framework", "torch", "--device", "cuda", check=False)
        assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr
        pytest.skip("no CUDA device on this machine")
    docs = {dev: json.loads(run("--framework", "torch", "--device", dev, "--numel", "30011",
                                "--repeats", "1", "--json").stdout) for dev in ("cpu", "cuda")}
    assert docs["cuda"]["device"] == "cuda"
    assert ([r["payload_bytes"] for r in docs["cuda"]["results"]]
            == [r["payload_bytes"] for r in docs["cpu"]["results"]])
