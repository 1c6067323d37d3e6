"""scripts/gpu_check.sh where it can run here: its help, and its refusal without a GPU
(its CUDA steps run on a lent GPU machine: docs/gpus.md)."""

import os
import subprocess
import sys
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
