"""hvd-compress installs as a library: the wheel a build makes carries what the package
needs at run time, imports in a fresh environment with numpy alone, and the framework
wrappers say at import what is missing (the framework, or Horovod built for it).

How the fresh environment is made, offline and in seconds:

* the wheel is built the way ``python -m build`` does it -- an sdist first (setuptools'
  PEP 517 hook), then ``pip wheel`` of that sdist (``--no-deps --no-build-isolation``:
  setuptools and wheel come from this environment, no download) -- from a copy of the
  repository's packaging files, so the checkout gets no ``build/`` or ``*.egg-info``;
* ``python -m venv --without-pip`` from the base interpreter (not
  ``--system-site-packages``): it sees the standard library only;
* ``pip --python <fresh venv> install --no-deps --no-index <wheel>`` installs the wheel
  with this environment's pip;
* numpy, our one install requirement, is made visible by a ``.pth`` file naming a folder
  that holds links to this environment's numpy (its package, ``numpy.libs`` and
  dist-info) and nothing else: the fresh environment has no PyTorch, TensorFlow,
  Horovod or numba, and never sees the checkout (it runs from a temporary folder).

Horovod missing beside a working PyTorch / TensorFlow is shown in this environment, with
``sys.modules["horovod"] = None`` (Python's way to make a module unimportable).
"""

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ["hvd_compress", "torch_examples", "tf_examples", "setup.py", "setup.cfg",
             "pyproject.toml", "MANIFEST.in", "README.md"]
FUSED_SOURCES = sorted(p.name for p in (ROOT / "hvd_compress" / "tensorflow" / "fused").glob("*.cc"))
EXAMPLES = {folder: sorted(p.name for p in (ROOT / folder).glob("*.py"))
            for folder in ("torch_examples", "tf_examples")}


def _version() -> str:
    tree = ast.parse((ROOT / "hvd_compress" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__version__"]:
            return node.value.value
    raise AssertionError("hvd_compress/__init__.py sets no __version__")


def _run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from an sdist of a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "build")
    for name in PACKAGING:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))")
    sdist = tmp / "sdist" / _run([sys.executable, "-c", code, str(tmp / "sdist")],
                                 cwd=src).strip().splitlines()[-1]
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(tmp / "wheel"), str(sdist)], cwd=tmp)
    (built,) = (tmp / "wheel").glob("hvd_compress-*.whl")
    return built


def test_wheel_holds_the_fused_op_sources_the_examples_and_the_metadata(wheel):
    version = _version()
    assert wheel.name.startswith(f"hvd_compress-{version}-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(f"hvd_compress-{version}.dist-info/METADATA").decode()
        entry_points = z.read(f"hvd_compress-{version}.dist-info/entry_points.txt").decode()
    for cc in FUSED_SOURCES:
        assert f"hvd_compress/tensorflow/fused/{cc}" in names
    for folder, scripts in EXAMPLES.items():
        for script in scripts:
            assert f"hvd_compress/tools/examples/{folder}/{script}" in names
    assert not any(n.startswith(("tests/", "torch_examples/", "tf_examples/")) for n in names)
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "extra ==" not in r] == ["numpy>=1.24"]
    assert any(r.startswith("torch") and 'extra == "torch"' in r for r in requires)
    assert any(r.startswith("tensorflow") and 'extra == "tensorflow"' in r for r in requires)
    assert "hvd-compress-compare = hvd_compress.tools.compare:main" in entry_points


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory) -> Path:
    """A new virtual environment with the wheel installed and numpy alone beside it."""
    import numpy

    tmp = tmp_path_factory.mktemp("venv")
    env = tmp / "env"
    venv.EnvBuilder(with_pip=False, system_site_packages=False, symlinks=True).create(env)
    python = env / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
          "--no-index", str(wheel)], cwd=tmp)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp).strip())
    numpy_only = tmp / "numpy-only"
    numpy_only.mkdir()
    numpy_site = Path(numpy.__file__).resolve().parent.parent
    for entry in numpy_site.iterdir():
        if entry.name == "numpy" or entry.name.startswith(("numpy.libs", "numpy-")):
            (numpy_only / entry.name).symlink_to(entry)
    (site / "numpy_only.pth").write_text(f"{numpy_only}\n")
    return python


def _in(python: Path, code: str) -> dict:
    """Run ``code`` (which prints one JSON line) in ``python`` from an empty folder."""
    cwd = python.parent.parent.parent
    out = _run([str(python), "-c", textwrap.dedent(code)], cwd=cwd)
    return json.loads(out.strip().splitlines()[-1])


def test_fresh_environment_imports_the_package_and_core_with_numpy_alone(fresh_env):
    got = _in(fresh_env, """
        import json, os, sys
        import hvd_compress, hvd_compress.core, hvd_compress.spec
        from hvd_compress.core import build
        import numpy as np
        comp = build("onebit")
        enc = comp.encode(np.ones((4, 3), np.float32), "w")
        total = comp.aggregate([enc.payload], enc)
        pkg = os.path.dirname(hvd_compress.__file__)
        fused = sorted(os.listdir(os.path.join(pkg, "tensorflow", "fused")))
        examples = {f: sorted(n for n in os.listdir(os.path.join(pkg, "tools", "examples", f))
                              if n.endswith(".py")) for f in ("torch_examples", "tf_examples")}
        loaded = sorted(m for m in ("torch", "tensorflow", "horovod", "numba") if m in sys.modules)
        unavailable = []
        for m in ("torch", "tensorflow", "horovod", "numba"):
            try:
                __import__(m)
            except ImportError:
                unavailable.append(m)
        print(json.dumps({"version": hvd_compress.__version__, "file": hvd_compress.__file__,
                          "prefix": sys.prefix, "fused": fused, "examples": examples,
                          "loaded": loaded, "unavailable": unavailable,
                          "total": total.tolist()}))
    """)
    assert got["version"] == _version()
    assert got["file"].startswith(got["prefix"]), "imported the checkout, not the installed wheel"
    assert got["unavailable"] == ["torch", "tensorflow", "horovod", "numba"], "not a fresh environment"
    assert got["loaded"] == []
    assert got["total"] == [[1.0, 1.0, 1.0]] * 4
    assert [n for n in got["fused"] if n.endswith(".cc")] == FUSED_SOURCES
    assert got["examples"] == EXAMPLES


@pytest.mark.parametrize("wrapper,framework", [("torch", "PyTorch"), ("tensorflow", "TensorFlow")])
def test_wrapper_without_its_framework_says_so_at_import(fresh_env, wrapper, framework):
    got = _in(fresh_env, f"""
        import json
        try:
            import hvd_compress.{wrapper}
            print(json.dumps({{"error": None}}))
        except ImportError as e:
            print(json.dumps({{"error": str(e), "name": e.name, "type": type(e).__name__}}))
    """)
    assert got["error"] is not None
    assert got["name"] == wrapper
    assert got["type"] == "ModuleNotFoundError"  # what pytest.importorskip skips on
    assert f"hvd_compress.{wrapper} needs {framework} ({wrapper})" in got["error"]
    assert f'pip install "hvd-compress[{wrapper}]"' in got["error"]


@pytest.mark.parametrize("wrapper,framework,flag", [
    ("torch", "PyTorch", "HOROVOD_WITH_PYTORCH"),
    ("tensorflow", "TensorFlow", "HOROVOD_WITH_TENSORFLOW"),
])
def test_wrapper_without_horovod_names_it_the_version_and_how_to_install(wrapper, framework, flag):
    """The framework is there (this environment's); Horovod is not, or (where Horovod is
    installed) its module for the framework does not import.  One process tries both."""
    pytest.importorskip(wrapper)
    blocked = ["horovod"] + ([f"horovod.{wrapper}"] if importlib.util.find_spec("horovod") else [])
    code = textwrap.dedent(f"""
        import json, sys
        got = []
        for module in {blocked!r}:
            sys.modules.pop("horovod", None)
            sys.modules[module] = None
            try:
                import hvd_compress.{wrapper}
                got.append({{"error": None}})
            except ImportError as e:
                got.append({{"error": str(e), "name": e.name, "type": type(e).__name__}})
            del sys.modules[module]
        print(json.dumps(got))
    """)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(blocked)
    for module, got in zip(blocked, results):
        message = got["error"]
        assert message is not None, f"hvd_compress.{wrapper} imported with {module} missing"
        assert got["name"] == module
        assert got["type"] == "ModuleNotFoundError"
        assert f"hvd_compress.{wrapper} needs Horovod" in message and f"{framework} support" in message
        if module == "horovod":
            assert "Horovod is not installed" in message
        else:
            assert f"horovod.{wrapper} does not import" in message
        assert "Horovod 0.28.1" in message and "scripts/setup.sh" in message
        assert f"{flag}=1 pip install --no-cache-dir horovod==0.28.1" in message
    if len(blocked) == 1:
        pytest.skip("Horovod is not installed here: its missing framework module is not tried")
