"""The compressor catalogue as a Markdown table, generated from the registry.

README.md carries this table between two marker comments; ``tests/test_readme.py``
regenerates it and fails when the README is out of step with the registry, so a
new algorithm (one :func:`hvd_compress.core.registry.register` call) shows up in
the README by running ``python -m hvd_compress.tools.catalogue --write README.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core import registry

__all__ = ["BEGIN", "END", "rows", "table", "splice", "main"]

BEGIN = ("<!-- catalogue: generated from hvd_compress/core/registry.py by "
         "`python -m hvd_compress.tools.catalogue --write README.md`; do not edit by hand -->")
END = "<!-- /catalogue -->"

_HEADER = ("| spec | class (`hc.` / `hct.`) | parameters (defaults) | collective | what it is |",
           "|---|---|---|---|---|")


def _fmt(value) -> str:
    if value is None:
        return "auto"  # derived from the other parameters (the entry's derive)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _collective(alg) -> str:
    # asked of a compressor built at the defaults: whether payloads add up may depend on them
    comp = alg.make(registry.defaults(alg.name))
    if comp.summable:
        return "allreduce"
    if getattr(comp, "variable_size", False):
        return "allgather, variable size"
    if "sum" in alg.params:
        return "allgather (`sum=int`: allreduce)"
    return "allgather"


def rows() -> list[tuple[str, str, str, str, str]]:
    """One row per registered algorithm, in registration order: spec name, class name,
    parameters with their defaults, the collective its payloads take, its one-line doc."""
    out = []
    for alg in registry.algorithms():
        params = ", ".join(f"`{key}={_fmt(p.default)}`" for key, p in alg.params.items())
        out.append((f"`{alg.name}`", f"`{alg.class_name}`", params or "—",
                    _collective(alg), _cell(alg.doc)))
    return out


def table() -> str:
    """The catalogue as Markdown (no markers, no trailing newline)."""
    return "\n".join(_HEADER + tuple("| " + " | ".join(r) + " |" for r in rows()))


def splice(text: str, generated: str) -> str:
    """``text`` with what lies between :data:`BEGIN` and :data:`END` replaced by ``generated``."""
    head, sep, rest = text.partition(BEGIN)
    if not sep:
        raise ValueError(f"no begin marker {BEGIN!r}")
    _, sep, tail = rest.partition(END)
    if not sep:
        raise ValueError(f"no end marker {END!r} after the begin marker")
    return f"{head}{BEGIN}\n{generated}\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hvd_compress.tools.catalogue",
        description="Print every registered compressor (spec name, class name, parameters "
                    "and defaults, collective) as a Markdown table; or put it into a file "
                    f"between the markers {BEGIN!r} and {END!r}.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", type=Path,
                       help="replace the table between the markers in PATH (e.g. README.md)")
    group.add_argument("--check", metavar="PATH", type=Path,
                       help="exit 1 if the table between the markers in PATH is out of date")
    args = parser.parse_args(argv)
    generated = table()
    if args.write is None and args.check is None:
        print(generated)
        return 0
    path = args.write or args.check
    text = path.read_text(encoding="utf-8")
    new = splice(text, generated)
    if args.check is not None:
        if new != text:
            print(f"{path}: the catalogue table is out of date; run "
                  f"python -m hvd_compress.tools.catalogue --write {path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
