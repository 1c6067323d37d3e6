"""hvd_compress.tools.hvdrun: horovodrun with its build probe cached (the launcher the
harness and the comparison use; every multi-process test runs through it)."""

import subprocess
import sys

from hvd_compress.tools import hvdrun
from tests.harness import REPO


def test_probe_runs_once_per_extension_build_and_question(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def probe(ext, fn, desc, verbose):
        calls.append((ext, desc))
        return {"built with Gloo": True, "built with MPI": False}[desc]

    checked = hvdrun.cached_probe(probe)
    assert checked("torch", None, "built with Gloo", False) is True
    assert checked("torch", None, "built with Gloo", False) is True
    assert checked("torch", None, "built with MPI", False) is False
    assert checked("torch", None, "built with MPI", False) is False
    assert calls == [("torch", "built with Gloo"), ("torch", "built with MPI")]
    assert hvdrun.cache_path().is_file()
    # another build of the extension (its files changed): probed again
    monkeypatch.setattr(hvdrun, "_stamp", lambda ext: "other-build")
    assert checked("torch", None, "built with Gloo", False) is True
    assert calls[-1] == ("torch", "built with Gloo") and len(calls) == 3
    # an extension that is not installed is never cached
    monkeypatch.setattr(hvdrun, "_stamp", lambda ext: None)
    assert checked("mxnet", None, "built with Gloo", False) is True
    assert checked("mxnet", None, "built with Gloo", False) is True
    assert len(calls) == 5


def test_a_broken_cache_file_is_probed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    hvdrun.cache_path().parent.mkdir(parents=True)
    hvdrun.cache_path().write_text("{not json")
    checked = hvdrun.cached_probe(lambda *a: True)
    assert checked("torch", None, "built with Gloo", False) is True
    assert '"torch|built with Gloo|' in hvdrun.cache_path().read_text()


def test_the_installed_torch_extension_has_a_stamp():
    stamp = hvdrun._stamp("torch")
    assert stamp is not None and "mpi_lib" in stamp
    assert hvdrun._stamp("no_such_framework") is None


def test_help_is_horovodruns():
    ours = subprocess.run([sys.executable, "-m", "hvd_compress.tools.hvdrun", "--help"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ours.returncode == 0 and "--gloo" in ours.stdout and "--min-np" in ours.stdout
    assert ours.stdout.startswith("usage: horovodrun")
