"""Rules of the code base that tests can check: lint, the core imports no framework, and the
core holds only the reference chains (fast paths live behind the backends)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "hvd_compress" / "core"


def test_core_imports_neither_torch_nor_tensorflow():
    offenders = []
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in ("torch", "tensorflow", "keras", "horovod"):
                    offenders.append(f"{path.name}: {name}")
    assert not offenders, offenders


def _imports(path):
    """(module, imported names) for every import in ``path``, relative ones as written."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [a.name]
        elif isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or ""), [a.name for a in node.names]


def test_core_takes_no_fast_path_of_its_own():
    """No module under core/ imports the numba kernels or their wrappers, or names numba:
    fast paths reach the core only through the backend's ``fused_encoder`` hook."""
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        if "numba" in path.read_text().lower():
            offenders.append(f"{path.name}: names numba")
        for module, names in _imports(path):
            parts = module.replace(".", " ").split() + names
            if any(p in ("kernels", "fastpaths") for p in parts):
                offenders.append(f"{path.name}: imports {module} {names}")
    assert not offenders, offenders


def test_importing_the_core_loads_no_framework():
    code = ("import sys, hvd_compress.core, hvd_compress.core.mpi_check, hvd_compress.spec;"
            "print(sorted(m for m in ('torch', 'tensorflow', 'horovod') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout.strip()
    assert out == "[]"


def test_importing_the_core_loads_no_numba():
    """numba loads with the first fast path asked for, not with the package."""
    code = "import sys, hvd_compress.core; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout.strip()
    assert out == "False"


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "hvd_compress", "tests", "scripts"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
