"""scripts/ab_versions.py: its ratios, and its command line (no benchmark is run here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ab_versions.py"


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab_versions", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ratios_are_new_over_old_per_key_median_over_rounds(ab):
    old = [{"a": 2.0, "b": 4.0, "only_old": 1.0}, {"a": 4.0, "b": 4.0, "only_old": 1.0},
           {"a": 1.0, "b": 0.0, "only_old": 1.0}]
    new = [{"a": 3.0, "b": 2.0}, {"a": 2.0, "b": 8.0}, {"a": 4.0, "b": 1.0}]
    got = ab._ratios(old, new, lambda v: v)
    assert got == {"a": 1.5, "b": 1.25}  # a: median(1.5, 0.5, 4.0); b: old 0 left out
    pairs = ab._ratios([{"k": (2.0, 8.0)}], [{"k": (1.0, 4.0)}], lambda t: t[1])
    assert pairs == {"k": 0.5}


def test_help_and_usage_errors():
    run = lambda *a: subprocess.run([sys.executable, str(SCRIPT), *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=60)
    helped = run("--help")
    assert helped.returncode == 0 and "--old" in helped.stdout and "new/old" in helped.stdout
    bad = run("--old", "no-such-revision-anywhere")
    assert bad.returncode == 2 and "is not a revision" in bad.stderr
    assert run("--old", "HEAD", "--rounds", "0").returncode == 2
