"""scripts/gpu_check.sh where it can run here: its help, and its refusal without a GPU
(its CUDA steps run on a lent GPU machine: docs/gpus.md)."""

import os
import subprocess
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
