"""The written surface holds together: every relative link in README.md and docs/*.md resolves
(the file, and the heading when the link names one), every `chunkscope JOB` shown names a
subcommand, every `python -m MODULE` of this repository names a module that exists, and no
document points outside the repository. Reads files only: no imports of the packages beyond the
command table, no network."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chunkscope.cli import BY_NAME

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# modules of other projects that the docs run with `python -m`
FOREIGN_MODULES = {"vllm", "pip", "pytest", "venv"}

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
# a command: at the start of a line (or after a shell separator), not the word in prose
CHUNKSCOPE = re.compile(r"(?:^[ \t]*(?:\$\s+)?|[;&|(`]\s*)chunkscope\s+([a-z][a-z-]*)", re.M)
PYTHON_M = re.compile(r"python3?\s+-m\s+([A-Za-z_][\w.]*)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = INLINE.sub("", text)
    return [m.group(1) for m in LINK.finditer(text)]


def _code(path: Path) -> list[str]:
    """Every fenced block and inline code span of a document."""
    text = path.read_text()
    blocks = [m.group(2) for m in FENCE.finditer(text)]
    rest = FENCE.sub("", text)
    return blocks + [m.group(1) for m in INLINE.finditer(rest)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_commands_shown_exist(doc: Path) -> None:
    missing = []
    for code in _code(doc):
        for m in CHUNKSCOPE.finditer(code):
            job = m.group(1)
            if job not in BY_NAME:
                missing.append(f"chunkscope {job}")
        for m in PYTHON_M.finditer(code):
            module = m.group(1).rstrip(".")
            top = module.split(".")[0]
            if top in FOREIGN_MODULES:
                continue
            parts = module.split(".")
            if any(p.isupper() for p in parts):  # a placeholder: benchmarks.NAME
                continue
            base = ROOT.joinpath(*parts)
            if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
                missing.append(f"python -m {module}")
    assert not missing, f"{doc.relative_to(ROOT)} shows commands that do not exist: {missing}"


def test_no_document_points_outside_the_repository() -> None:
    outside = [d.relative_to(ROOT).as_posix() for d in DOCS if "../shared" in d.read_text()]
    assert not outside, f"these documents refer to ../shared: {outside}"


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    # the link and command patterns on a made-up page, so a regex that matches nothing fails here
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n## Its `second` part\n\nSee [x](other.md#top) and ![pic](img/a.png).\n\n"
        "```bash\nchunkscope nosuchjob --x\n.venv/bin/python -m engine.nosuchmodule\n```\n"
        "Prose about the chunkscope bridge names no job.\n"
    )
    assert _links(page) == ["other.md#top", "img/a.png"]
    assert _anchors(page) == {"a-page", "its-second-part"}
    code = _code(page)
    assert [m.group(1) for c in code for m in CHUNKSCOPE.finditer(c)] == ["nosuchjob"]
    assert [m.group(1) for c in code for m in PYTHON_M.finditer(c)] == ["engine.nosuchmodule"]
