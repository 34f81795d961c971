"""Write docs/cli.md, the reference of the `chunkscope` command, from its parsers.

    .venv/bin/python scripts/cli_reference.py          # (re)write docs/cli.md
    .venv/bin/python scripts/cli_reference.py --check  # exit 1 if docs/cli.md is out of date

Each section is the `--help` text of one subcommand, printed at 100 columns with the
CHUNKSCOPE_* environment variables unset (some defaults come from them), so that the file does
not depend on the machine or the shell it was generated in. tests/chunkscope/test_cli.py fails
when docs/cli.md differs from what this prints.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "cli.md"
COLUMNS = "100"

_HEADER = """\
# Command-line reference

Every job has a subcommand of the `chunkscope` command (installed with the package); `chunkscope
SUBCOMMAND --help` prints the same text as its section here. The `python -m ...` forms named in
`chunkscope --help` run the same code. Options that default to an environment variable show the
default with the variable unset.

This file is generated from the command's parsers by `python scripts/cli_reference.py`; a test
fails when it is out of date.
"""


@contextlib.contextmanager
def _stable_environment() -> Iterator[None]:
    """A fixed help width, no colours and no CHUNKSCOPE_* variables, restored afterwards."""
    saved = dict(os.environ)
    try:
        for key in list(os.environ):
            if key.startswith("CHUNKSCOPE_"):
                del os.environ[key]
        os.environ["COLUMNS"] = COLUMNS
        os.environ["NO_COLOR"] = "1"
        os.environ.pop("FORCE_COLOR", None)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def help_text(argv: list[str]) -> str:
    """What `chunkscope ARGV` prints on stdout; AssertionError unless it exits 0."""
    from chunkscope.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code: object = main(argv)
        except SystemExit as exc:
            code = exc.code
    if code not in (0, None):
        raise AssertionError(f"chunkscope {' '.join(argv)} exited {code}")
    return out.getvalue()


def commands() -> list[list[str]]:
    """Every help in the reference: the command's, then each subcommand's (and its nested
    forms', e.g. `control engines`)."""
    from chunkscope.cli import SUBCOMMANDS

    out: list[list[str]] = [[]]
    for sub in SUBCOMMANDS:
        out.append([sub.name])
        out += [[sub.name, word] for word in sub.nested]
    return out


def render() -> str:
    with _stable_environment():
        sections = [
            (" ".join(["chunkscope", *words]), help_text([*words, "--help"]))
            for words in commands()
        ]
    lines = [_HEADER]
    lines += [f"- [`{title}`](#{title.replace(' ', '-')})" for title, _ in sections]
    for title, text in sections:
        lines += ["", f"## {title}", "", "```text", text.rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args == ["--check"]:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: cli_reference.py [--check]", file=sys.stderr)
        return 2
    OUT.write_text(text)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
