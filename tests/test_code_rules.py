"""Rules of the code base that tests can check: lint, the core imports no framework, and the
core holds only the reference chains (fast paths live behind the backends)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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
            if any(p in ("kernels", "fastpaths", "accel") for p in parts):
                offenders.append(f"{path.name}: imports {module} {names}")
    assert not offenders, offenders


def test_importing_the_core_loads_no_framework():
    code = ("import sys, hvd_compress.core, hvd_compress.tools.mpi_check, hvd_compress.spec;"
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


# -- the layers (issue 37): the module import graph --------------------------------------------
# Every ``import`` in a module counts, lazy ones inside functions included: a lazy import
# still makes the module depend on the other at run time (it only hides a circle from the
# order of imports), so it is an edge like any other.  ``importlib.import_module`` with a
# literal name (or ``f"{__name__}.x"``) counts too.  ``from pkg import name`` is an edge to
# the submodule ``pkg.name`` when there is one, else to ``pkg``; that importing a submodule
# first runs its parents' ``__init__`` is not counted (a package's ``__init__`` is its
# public face and re-exports its members; counting it would make every such package a
# circle with them).
PACKAGE = ROOT / "hvd_compress"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_modules() -> dict:
    """module name -> path for every module of the package (the copies of the example
    scripts a build puts under tools/examples/ are scripts, not modules)."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
            if "examples" not in p.relative_to(PACKAGE).parts[:-1]}


def _targets(module: str, path: Path, node, modules) -> list[str]:
    """The modules ``node`` (an import, or a call of importlib.import_module) imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = package[:len(package) - node.level + 1]
            full = ".".join(base + ([node.module] if node.module else []))
        else:
            full = node.module
        subs = [f"{full}.{a.name}" for a in node.names if f"{full}.{a.name}" in modules]
        return subs + ([full] if len(subs) < len(node.names) else [])
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name != "import_module" or not node.args:
        return []
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and len(arg.values) == 2:  # f"{__name__}.x"
        head, tail = arg.values
        if isinstance(head, ast.FormattedValue) and getattr(head.value, "id", "") == "__name__" \
                and isinstance(tail, ast.Constant):
            return [module + tail.value]
    return []


def import_graph() -> dict:
    """module -> the set of the package's modules it imports (anywhere in its code)."""
    modules = _package_modules()
    graph = {}
    for module, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.Call)):
                deps.update(t for t in _targets(module, path, node, modules) if t in modules and t != module)
        graph[module] = deps
    return graph


def circles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_circle_finder_finds_circles_lazy_imports_included(tmp_path):
    """The rule's own check: a three-module circle closed by a lazy import is one component;
    a chain and a package re-exporting its members are none."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "pkg": {"pkg.x"}, "pkg.x": set()}
    assert circles(graph) == [["a", "b", "c"]]
    lazy = ("from __future__ import annotations\n\n\ndef f():\n    from .b import g\n    return g\n")
    tree = ast.parse(lazy)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level)
    assert _targets("p.a", tmp_path / "a.py", node, {"p.a", "p.b"}) == ["p.b"]


def _part(module: str) -> str:
    """The layer a module belongs to: core, accel, torch, tensorflow, tools, or the
    package's own top level (session, frontend, pertensor, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "top"


@pytest.mark.parametrize("part", ["core", "accel", "top", "torch", "tensorflow", "tools"])
def test_no_import_circle(part):
    """No module of ``part`` is in an import circle: modules in a circle can only be read,
    tested and loaded together, and nothing says which stands on which."""
    found = [c for c in circles(import_graph()) if any(_part(m) == part for m in c)]
    assert not found, found


def _imports_across(parts, allowed) -> list[str]:
    """``A imports B`` for every module A of ``parts`` importing a module B of the package
    whose part is not in ``allowed``."""
    return [f"{m} imports {d}" for m, deps in sorted(import_graph().items()) if _part(m) in parts
            for d in sorted(deps) if _part(d) not in allowed]


def test_the_core_imports_nothing_outside_the_core():
    """The core (the reference algorithms and the spec grammar) stands on numpy alone."""
    assert _imports_across({"core"}, {"core"}) == []


def test_the_accelerators_import_only_the_core():
    assert _imports_across({"accel"}, {"accel", "core"}) == []


def test_the_library_does_not_import_the_tools():
    """The tools (comparison, launchers, the examples' plumbing) stand on the library, never
    under it: a training script needs none of them."""
    library = {"core", "accel", "torch", "tensorflow", "top"}
    assert _imports_across(library, library) == []



# -- sizes: rooms people can read (issue 37) ----------------------------------------------------
MAX_LINES = 600
#: the thin shells over the wrapper session: each hands gradients and collectives to it
WRAPPERS = ("hvd_compress/torch/optimizer.py", "hvd_compress/torch/distributed.py",
            "hvd_compress/tensorflow/tape.py", "hvd_compress/tensorflow/keras.py")
MAX_WRAPPER_LINES = 200
#: where the code is: Python and shell sources (the TensorFlow ops' C++ is left out, as are
#: the copies of the examples a build makes under hvd_compress/tools/examples/)
SOURCE_FOLDERS = ("hvd_compress", "tests", "scripts", "torch_examples", "tf_examples")


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _sources() -> list[Path]:
    found = [ROOT / "setup.py"]
    for folder in SOURCE_FOLDERS:
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh")
                  and not {"__pycache__", "examples"} & set(p.relative_to(ROOT).parts[1:-1])]
    return sorted(found)


def test_the_size_rule_sees_every_module():
    """The files the size rule reads include every module of the package and no C++."""
    sources = set(_sources())
    assert set(_package_modules().values()) <= sources
    assert ROOT / "tests" / "test_code_rules.py" in sources
    assert not [p for p in sources if p.suffix in (".cc", ".h")]


def test_no_source_file_above_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := _lines(p)) > MAX_LINES}
    assert long == {}


def test_the_wrappers_are_thin_shells():
    """The torch optimizer (its shell class and the function that makes it), the TF tape
    and the Keras optimizer hand their gradients to the framework-neutral session; each
    is at most 200 lines."""
    sizes = {name: _lines(ROOT / name) for name in WRAPPERS}
    assert {k: n for k, n in sizes.items() if n > MAX_WRAPPER_LINES} == {}, sizes


# -- no dispatch on an algorithm's name (issue 37, part 2) --------------------------------------
#: where an algorithm's name may be compared: the registry and the spec grammar (the codec
#: modules that define ``name = "<algorithm>"`` are left out as well, by :func:`_defines_one`)
NAME_TABLES = ("hvd_compress/core/registry.py", "hvd_compress/core/spec.py")


def _algorithm_names() -> set:
    from hvd_compress.core import registry
    return {a.name for a in registry.algorithms()}


def _defines_one(tree, names) -> bool:
    """Whether a class in ``tree`` says ``name = "<algorithm>"`` (a codec module)."""
    return any(isinstance(node, ast.ClassDef) and any(
        isinstance(st, ast.Assign) and isinstance(st.value, ast.Constant) and st.value.value in names
        and any(isinstance(t, ast.Name) and t.id == "name" for t in st.targets) for st in node.body)
        for node in ast.walk(tree))


def name_comparisons(tree, names) -> list[int]:
    """Lines comparing a ``.name`` with an algorithm's name: ``x.name == "dgc"``,
    ``"dgc" != x.name``, ``x.name in ("topk", "dgc")``, any comparison of the kind."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = set()
        for o in operands:
            for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o]):
                if isinstance(e, ast.Constant) and isinstance(e.value, str):
                    literals.add(e.value)
        if literals & names and any(isinstance(o, ast.Attribute) and o.attr == "name"
                                    for o in operands):
            found.append(node.lineno)
    return sorted(found)


def test_the_name_rule_finds_comparisons_with_an_algorithms_name():
    names = {"none", "dgc", "powersgd", "randomk"}
    source = ("a = s.name != 'none'\n"
              "b = any(p.name == 'powersgd' for p in s.parts)\n"
              "c = comp.spec.parts[0].name in ('randomk', 'x')\n"
              "d = 'dgc' == s.name\n"
              "e = r['compression'] == 'none'\n"       # a row's label, no .name
              "f = t.name == 'fc.weight'\n"            # a tensor's name
              "class Mine:\n    name = 'dgc'\n")
    tree = ast.parse(source)
    assert name_comparisons(tree, names) == [1, 2, 3, 4]
    assert _defines_one(tree, names) and not _defines_one(ast.parse(source[:-25]), names)


def test_nothing_dispatches_on_an_algorithms_name():
    """Outside the registry, the spec grammar and the codec modules, what an algorithm needs
    is asked of its class (``passes_through``, ``core_of(spec).owns_momentum``,
    ``chains_rounds``, ...), never read from its name."""
    names = _algorithm_names()
    found = []
    for path in _package_modules().values():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        if rel in NAME_TABLES or _defines_one(tree, names):
            continue
        found += [f"{rel}:{line}" for line in name_comparisons(tree, names)]
    assert found == [], found
