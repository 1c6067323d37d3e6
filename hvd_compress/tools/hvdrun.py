"""``horovodrun`` without the seconds its start-up probe costs: ``python -m hvd_compress.tools.hvdrun``.

The same launcher (``horovod.runner.launch.run_commandline``: every flag, the
same processes and environment).  Before it launches, ``horovodrun`` asks which
controllers Horovod was built with (Gloo, MPI) by importing a framework extension
in a forked process -- TensorFlow's first, about 4 s here, for every launch.
This asks PyTorch's extension first (TensorFlow's when PyTorch is absent) and
keeps each answer in a small cache (``~/.cache/hvd_compress/horovod_probe.json``,
``$XDG_CACHE_HOME`` respected) keyed by the extension files' size and time, so a
rebuilt or reinstalled Horovod is probed again.  The comparison tool and the test
harness launch with it (about 4 s saved per launch); ``horovodrun`` itself works
the same.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ORDER = ["torch", "tensorflow", "mxnet"]  # cheapest framework to import first


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hvd_compress" / "horovod_probe.json"


def _stamp(ext_base_name: str) -> str | None:
    """Size and modification time of the extension's shared libraries, or None when
    the extension is not installed (the probe then runs, and fails fast)."""
    import horovod
    folder = Path(horovod.__file__).parent / ext_base_name
    libs = sorted(folder.glob("mpi_lib*.so")) if folder.is_dir() else []
    if not libs:
        return None
    return ";".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in libs)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a read-only home: probe every time, as horovodrun does
        pass


def cached_probe(probe):
    """``probe`` (Horovod's ``_check_extension_lambda``), answered from the cache when
    the same extension files were probed for the same question before."""
    def checked(ext_base_name, fn, fn_desc, verbose):
        stamp = _stamp(ext_base_name)
        if stamp is None:
            return probe(ext_base_name, fn, fn_desc, verbose)
        key = f"{ext_base_name}|{fn_desc}|{stamp}"
        path = cache_path()
        cache = _read(path)
        if key in cache:
            return cache[key]
        result = probe(ext_base_name, fn, fn_desc, verbose)
        if result is None or isinstance(result, (bool, int)):
            cache[key] = result
            _write(path, cache)
        return result
    return checked


def main() -> int:
    from horovod.common import util
    util.EXTENSIONS = ORDER + [e for e in util.EXTENSIONS if e not in ORDER]
    util._check_extension_lambda = cached_probe(util._check_extension_lambda)
    from horovod.runner.launch import run_commandline
    sys.argv[0] = "horovodrun"
    return run_commandline()


def command() -> list[str]:
    """The argv prefix that launches like ``horovodrun`` (this module, this interpreter)."""
    return [sys.executable, "-m", "hvd_compress.tools.hvdrun"]


if __name__ == "__main__":  # (the guard matters: Horovod's launcher spawns processes)
    sys.exit(main())
