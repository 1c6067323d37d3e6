"""scripts/gpu_check.sh where it can run here: its help, and its refusal without a GPU
(its CUDA steps run on a lent GPU machine: docs/gpus.md)."""

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def test_help_names_the_steps_and_nccl_and_no_gpu_is_refused(tmp_path):
    helped = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True,
                            timeout=30)
    assert helped.returncode == 0
    for word in ("NCCL", "GPU_CHECK_STEPS", "examples", "compare", "--device cuda"):
        assert word in helped.stdout, word
    # no nvidia-smi on the PATH: refused at once, saying why, nothing built
    env = {**os.environ, "PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    if subprocess.run(["bash", "-c", "command -v nvidia-smi"], env=env).returncode == 0:
        return  # a GPU machine: the refusal cannot be seen here
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30,
                         env=env, cwd=tmp_path)
    assert res.returncode == 1
    assert "no NVIDIA GPU here" in res.stderr
    assert not list((tmp_path / "out").glob("horovod-build-*.log"))


def test_nccl_is_staged_from_the_wheel_cuda_torch_brings(tmp_path):
    """scripts/nccl_home.sh's stage_nccl (setup.sh and gpu_check.sh build Horovod with it):
    the nvidia-nccl wheel's folder made into one CMake finds (lib/libnccl.so), the caller's
    HOROVOD_NCCL_HOME first, and a failure where there is neither."""
    wheel = tmp_path / "site" / "nvidia" / "nccl"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    (wheel / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    (wheel / "lib" / "libnccl.so.2").write_bytes(b"\x7fELF")

    def stage(site=None, home=None):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_NCCL")}
        env["PYTHONPATH"] = str(site) if site else ""
        if home:
            env["HOROVOD_NCCL_HOME"] = home
        return subprocess.run(["bash", "-c", f'source "{REPO}/scripts/nccl_home.sh" && '
                               f'stage_nccl "{sys.executable}" "{tmp_path}/stage"'],
                              capture_output=True, text=True, env=env, timeout=60)

    got = stage(tmp_path / "site")
    assert got.returncode == 0 and got.stdout.strip() == f"{tmp_path}/stage", got
    assert (tmp_path / "stage" / "lib" / "libnccl.so").resolve() == wheel / "lib" / "libnccl.so.2"
    assert (tmp_path / "stage" / "include" / "nccl.h").read_text().startswith("#define NCCL_MAJOR")
    assert stage(tmp_path / "site", home="/opt/nccl").stdout.strip() == "/opt/nccl"
    none = stage(tmp_path / "empty")
    assert none.returncode == 1 and none.stdout == ""


def test_device_session_plans_both_lanes_within_its_deadline(tmp_path):
    """scripts/device_session.sh (one device call, two lanes): its help; a dry run prints
    every step's command, each with a time-out inside LIMIT, and at most 8 files under
    OUT (what a device call brings back); a stray argument is refused."""
    script = REPO / "scripts" / "device_session.sh"
    helped = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True,
                            timeout=30)
    assert helped.returncode == 0 and "LIMIT" in helped.stdout and "NODES_BANDWIDTHS" in helped.stdout
    bad = subprocess.run(["bash", str(script), "now"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--help" in bad.stderr
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "LIMIT": "300", "OUT": str(out),
           "NODES_BANDWIDTHS": "200mbit uncapped"}
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         env=env)
    assert res.returncode == 0, res.stderr
    logged = "".join(p.read_text() for p in out.iterdir() if p.suffix in (".log", ".txt"))
    for step in ("tests/test_triton_kernels.py", "scripts/bench_kernels.py --framework torch "
                 "--device cuda", "tests/test_torch_multiprocess.py"):
        assert step in logged, step
    assert "lane" not in res.stderr and "done" in res.stdout
    files = [p.name for p in out.iterdir()]
    assert len(files) <= 8 and "results.tgz" in files, files
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("compare-nodes.log") for n in names), names
    assert any(n.endswith("build.log") for n in names), names
    timeouts = [int(t) for t in re.findall(r"timeout (?:-s INT )?(\d+)", logged)]
    assert len(timeouts) >= 2 and all(0 < t <= 300 for t in timeouts), timeouts


def test_device_session_runs_each_matrix_line_with_its_own_arguments(tmp_path):
    """NODES_MATRICES: a line a matrix, in turn; a line's optional sixth and seventh fields
    are more compare arguments and the example's own (the language model's matrix), the
    others keep NODES_EXAMPLE_ARGS."""
    out = tmp_path / "out"
    lines = ("8|4|200mbit|topk:ratio=0.01|two-phase\n"
             "4|2|200mbit|none|  |--example lm --optimizer adamw onebit-adam --diloco 50|"
             "--steps 300 --freeze-step 40")
    env = {**os.environ, "DRY_RUN": "1", "LIMIT": "300", "OUT": str(out), "LANES": "b",
           "NODES_MATRICES": lines, "NODES_EXAMPLE_ARGS": "--width 64"}
    res = subprocess.run(["bash", str(REPO / "scripts" / "device_session.sh")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    with tarfile.open(out / "results.tgz") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("compare-nodes.log"))
        ran = [ln for ln in tar.extractfile(member).read().decode().splitlines()
               if "hvd_compress.tools.compare" in ln and "--resume" not in ln]
    assert len(ran) == 2, ran
    assert "--np 8 --nodes 4" in ran[0] and "--exchange two-phase" in ran[0]
    assert "--example-args --width 64 " in ran[0] and "--example lm" not in ran[0]
    assert "--np 4 --nodes 2" in ran[1] and "--exchange" not in ran[1]
    assert "--example lm --optimizer adamw onebit-adam --diloco 50" in ran[1]
    assert "--example-args --steps 300 --freeze-step 40 " in ran[1]
    assert "taskset -c 0-15" in ran[0]  # lane B alone: every core
