"""The language-model example's runs (tests/test_lm_example.py), in the np 2 Gloo launch
other modules share (tests.launches): its ``main(argv)`` once per run, in the same workers
(it seeds every run at its start)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from .entry import _rank
from .examples import run_main

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
        run_main(key, main, argv)
        path = Path(argv[argv.index("--json") + 1])
        docs[key] = json.loads(path.read_text()) if _rank() == 0 else None
    return docs
