"""The example scripts, several runs in one launch (tests/test_tensorflow_examples.py,
tests/test_torch_examples.py).

Launching ``horovodrun python <folder>/<script>.py`` costs seconds before the script's
first step (the launcher, the framework imported in every worker, ``hvd.init``: about
12 s for TensorFlow, 4 s for PyTorch), so the tests run the scripts' ``main(argv)`` one
after another in the same workers, each as if in a process of its own: the scripts seed
every run at its start, and for TensorFlow Keras's global state is cleared first (layer
names, hence the compressors' state keys, start afresh)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
from pathlib import Path

from .entry import _rank

REPO = Path(__file__).resolve().parents[2]


def run_main(key, main, argv) -> io.StringIO:
    """``main(argv)`` with its output captured (returned) and then written, under ``key``,
    into the launch's output too (shown when the launch fails)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            main([str(a) for a in argv])
    finally:
        sys.stdout.write(f"---- {key} ----\n{out.getvalue()}")
        sys.stdout.flush()
    return out


def run(folder, runs):
    """Run each ``[key, script, argv]`` of ``folder`` (``tf_examples`` or ``torch_examples``)
    in order; returns ``{key: {"out": what main printed (stdout and stderr), "doc": its
    --json summary, or None}}`` (the summary in rank 0's result, which writes it)."""
    sys.path.insert(0, str(REPO / folder))
    results = {}
    for key, script, argv in runs:
        if folder == "tf_examples":
            import keras
            keras.backend.clear_session()
        out = run_main(key, importlib.import_module(Path(script).stem).main, argv)
        path = argv[argv.index("--json") + 1] if "--json" in argv else None
        doc = json.loads(Path(path).read_text()) if path and _rank() == 0 else None
        results[key] = {"out": out.getvalue(), "doc": doc}
    return results


def run_code(code, name):
    """Run a script's text ``code`` (README's quick starts) as ``__main__`` in this worker;
    returns what it printed."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        sys.stdout.write(f"---- {name} ----\n{out.getvalue()}")
        sys.stdout.flush()
    return out.getvalue()
