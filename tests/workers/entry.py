"""Worker entry point for tests/harness.py: ``python -m tests.workers.entry module:function``.

The rank comes from whichever launcher started us (Horovod or Open MPI sets it
in the environment); the result goes to ``$HVD_TEST_OUTDIR/rank<N>.json`` and a
traceback, if any, to ``rank<N>.err``.  Under elastic Horovod, where ranks change
and a new process may take a rank another had, the files are ``worker<pid>.*``.
"""

import importlib
import json
import os
import sys
import traceback


def _rank() -> int:
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _stem() -> str:
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        return f"worker{os.getpid()}"
    return f"rank{_rank()}"


def resolve(target: str):
    """The worker function ``"module:function"`` names."""
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def main() -> int:
    target = sys.argv[1]
    outdir = os.environ["HVD_TEST_OUTDIR"]
    rank = _rank()
    stem = _stem()
    try:
        with open(os.path.join(outdir, "kwargs.json")) as f:
            kwargs = json.load(f)
        result = resolve(target)(**kwargs)
    except BaseException:
        text = traceback.format_exc()
        with open(os.path.join(outdir, f"{stem}.err"), "w") as f:
            f.write(text)
        sys.stderr.write(f"[rank {rank}] {text}")
        sys.stderr.flush()
        os._exit(1)  # do not wait for peers stuck in a collective
    with open(os.path.join(outdir, f"{stem}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
