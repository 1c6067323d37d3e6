"""README.md stays one screen that tells the truth: its catalogue is the registry's, its
links lead somewhere, its commands are CI's, its quick starts run, and the package's
version is the newest in CHANGELOG.md."""

import re
from pathlib import Path

import pytest

import hvd_compress
from hvd_compress.tools import catalogue
from tests.harness import REPO
from tests.launches import TF_GLOO, TORCH_GLOO

README = REPO / "README.md"
DOCS = REPO / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set:
    text = re.sub(r"^```.*?^```", "", _text(path), flags=re.M | re.S)  # no comments in code
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _broken_links(path: Path) -> list[str]:
    broken = []
    text = re.sub(r"^```.*?^```", "", _text(path), flags=re.M | re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    return broken


def test_catalogue_table_is_the_registrys():
    text = _text(README)
    assert catalogue.splice(text, catalogue.table()) == text, (
        "README's catalogue is out of step with the registry: run "
        "python -m hvd_compress.tools.catalogue --write README.md")
    assert catalogue.main(["--check", str(README)]) == 0


def test_catalogue_names_every_algorithm_and_default():
    from hvd_compress.core import registry
    table = catalogue.table()
    for alg in registry.algorithms():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{alg.name}` |"))
        assert f"`{alg.class_name}`" in row
        for key in alg.params:
            assert f"`{key}=" in row, (alg.name, key)
    assert 'dgc` | `DGC` | `ratio=0.001`' in table and "`rank=2`" in table


def test_catalogue_check_fails_on_a_stale_table(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text(_text(README).replace("`ratio=0.001`", "`ratio=0.5`", 1), encoding="utf-8")
    assert catalogue.main(["--check", str(stale)]) == 1
    assert catalogue.main(["--write", str(stale)]) == 0
    assert _text(stale) == _text(README)


def test_catalogue_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        catalogue.main(["--help"])
    assert exit_.value.code == 0 and "--write PATH" in capsys.readouterr().out


def test_readme_is_one_screen_of_at_most_300_lines():
    assert len(_text(README).splitlines()) <= 300


def test_readme_links_exist_and_lead_to_docs():
    text = _text(README)
    docs_links = [t for t in LINK.findall(text) if t.startswith("docs/")]
    assert docs_links, "README links to no docs/ page"
    for page in ("architecture", "compressors", "comparing", "gpus", "testing"):
        assert f"docs/{page}.md" in docs_links
    assert _broken_links(README) == []


def test_docs_pages_links_exist():
    pages = sorted(DOCS.rglob("*.md")) + [REPO / "CHANGELOG.md"]
    broken = [b for page in pages for b in _broken_links(page)]
    assert broken == []
    # every page is reachable from the README or from a page it links to
    reachable, todo = set(), [README]
    while todo:
        page = todo.pop()
        for target in LINK.findall(_text(page)):
            dest = (page.parent / target.partition("#")[0]).resolve()
            if dest.suffix == ".md" and dest.exists() and dest not in reachable:
                reachable.add(dest)
                todo.append(dest)
    assert [p for p in DOCS.rglob("*.md") if p.resolve() not in reachable] == []


def test_readme_commands_are_cis():
    """.ci/run runs the README's set-up command, then its test command, verbatim."""
    ci = [line for line in _text(REPO / ".ci" / "run").splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["bash scripts/setup.sh", ".venv/bin/python -m pytest tests"]
    commands = [block.strip() for block in _blocks(_text(README), "bash")]
    for line in ci:
        assert line in commands


def test_version_is_the_newest_in_the_changelog():
    versions = re.findall(r"^## (\d+\.\d+\.\d+)", _text(REPO / "CHANGELOG.md"), flags=re.M)
    assert versions and hvd_compress.__version__ == versions[0]
    key = [tuple(map(int, v.split("."))) for v in versions]
    assert key == sorted(key, reverse=True), "CHANGELOG.md: newest first"


# the quick starts run as __main__ in the np 2 Gloo launches other modules share
# (tests.launches: launching costs seconds)
QUICK_STARTS = {"quickstart_torch.py": TORCH_GLOO, "quickstart_tf.py": TF_GLOO}
for _name, _launch in QUICK_STARTS.items():
    _code = next((b for b in _blocks(_text(README), "python") if b.startswith(f"# {_name}\n")), None)
    if _code is not None:  # (else the test below fails)
        _launch.add(__name__, _name, "tests.workers.examples:run_code", {"code": _code, "name": _name})


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(QUICK_STARTS, reverse=True))
def test_quick_start_runs_on_two_workers(name, request):
    assert any(b.startswith(f"# {name}\n") for b in _blocks(_text(README), "python")), name
    out = QUICK_STARTS[name].results(request, name)[0]  # what rank 0 printed
    if name == "quickstart_torch.py":
        assert "bytes_sent" in out
