"""The language-model example's runs (tests/test_lm_example.py), in the np 2 Gloo launch
other modules share (tests.launches): its ``main(argv)`` once per run, in the same workers
(it seeds every run at its start)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from .entry import _rank

REPO = Path(__file__).resolve().parents[2]


def run(runs):
    """``runs``: ``[key, argv]`` pairs; each runs with ``--json`` into a folder of its own
    here; returns ``{key: its summary}`` on rank 0 (None on the others)."""
    sys.path.insert(0, str(REPO / "torch_examples"))
    from train_lm import main
    docs = {}
    folder = Path(tempfile.mkdtemp(prefix="lm-example-"))
    for key, argv in runs:
        argv = [*argv, "--json", str(folder / f"{key}.json")]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                main([str(a) for a in argv])
        finally:  # into the launch's output too (shown when the launch fails)
            sys.stdout.write(f"---- {key} ----\n{out.getvalue()}")
            sys.stdout.flush()
        path = Path(argv[argv.index("--json") + 1])
        docs[key] = json.loads(path.read_text()) if _rank() == 0 else None
    return docs
