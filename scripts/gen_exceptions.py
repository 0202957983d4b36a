"""Writes the native exception lists of `waltz.errors` and of the stub `waltz/_native.pyi` from
the one table in the extension (`waltz._native.EXCEPTIONS`, generated in
rust/src/python/errors.rs), between their `BEGIN generated exceptions` and `END` markers.

    python scripts/gen_exceptions.py          # rewrite the blocks
    python scripts/gen_exceptions.py --check  # exit 1 if a block is out of date

Run it after changing the table (and rebuilding the extension);
tests/engine/unit/test_exception_table.py fails until the blocks match.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
ERRORS = ROOT / "python" / "waltz" / "errors.py"
STUB = ROOT / "python" / "waltz" / "_native.pyi"
BEGIN = "# BEGIN generated exceptions {what} (scripts/gen_exceptions.py from waltz._native.EXCEPTIONS)\n"
END = "# END generated exceptions {what}\n"


def table() -> list[tuple[str, str, str]]:
    from waltz._native import EXCEPTIONS

    return [(name, base, doc) for name, base, doc in EXCEPTIONS]


def blocks(rows: list[tuple[str, str, str]]) -> dict[tuple[pathlib.Path, str], str]:
    names = sorted(name for name, _, _ in rows)
    imports = "from waltz._native import (\n" + "".join(f"    {n},\n" for n in names) + ")\n\n"
    exports = "__all__ += [\n" + "".join(f'    "{n}",\n' for n in names) + "]\n"
    stub = "".join(f'class {name}({base}):\n    """{doc}"""\n\n' for name, base, doc in rows)
    return {(ERRORS, "imports"): imports, (ERRORS, "exports"): exports, (STUB, "classes"): stub}


def render(text: str, what: str, body: str) -> str:
    begin, end = BEGIN.format(what=what), END.format(what=what)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"no '{begin.strip()}' ... '{end.strip()}' block")
    return pattern.sub(lambda _: begin + body + end, text, count=1)


def stale() -> dict[pathlib.Path, str]:
    """The files whose generated blocks differ from the table, with their text as it should be."""
    out: dict[pathlib.Path, str] = {}
    for (path, what), body in blocks(table()).items():
        out[path] = render(out.get(path, path.read_text()), what, body)
    return {path: text for path, text in out.items() if path.read_text() != text}


def main(argv: list[str]) -> int:
    texts = stale()
    if "--check" in argv:
        for p in texts:
            print(f"{p.relative_to(ROOT)}: the exception block is out of date; run scripts/gen_exceptions.py")
        return 1 if texts else 0
    for p, text in texts.items():
        p.write_text(text)
        print(f"rewrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
