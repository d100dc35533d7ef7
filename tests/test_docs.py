"""Every reference to the project's docs (in code, presets, the Makefile, the README and the docs
themselves) names a file that exists and, with `#anchor`, an anchor that file defines."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("schemas", "stages", "pipelines", "flows", "cluster", "benchmarks", "tests", "docs")
REFERENCE = re.compile(r"docs/([a-z_]+\.md)(#[a-z0-9_-]+)?")  # in code, presets, README
LINK = re.compile(r"\]\(([a-z_]+\.md)(#[a-z0-9_-]+)?\)")  # markdown links between the docs
ANCHOR = re.compile(r'<a id="([a-z0-9_-]+)"></a>')


def _files():
    yield from (ROOT / n for n in ("README.md", "Makefile", "pyproject.toml"))
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".yaml", ".toml") and "__pycache__" not in path.parts:
                yield path


def test_doc_references_resolve():
    docs = {p.name: set(ANCHOR.findall(p.read_text())) for p in (ROOT / "docs").glob("*.md")}
    assert {"design.md", "algorithms.md", "recipes.md"} <= set(docs)
    checked, broken = 0, []
    for path in _files():
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            pattern = LINK if path.parent.name == "docs" else REFERENCE
            for m in pattern.finditer(line):
                name, anchor = m.group(1), m.group(2)
                where = f"{path.relative_to(ROOT)}:{line_no}"
                checked += 1
                if name not in docs:
                    broken.append(f"{where}: {m.group(0)} (no such file in docs/)")
                elif anchor and anchor[1:] not in docs[name]:
                    broken.append(f"{where}: {m.group(0)} (no anchor {anchor} in docs/{name})")
    assert not broken, "\n".join(broken)
    assert checked >= 15  # the code does cite the docs


def test_no_reference_to_notes_outside_the_repository():
    outside = re.compile(r"\b(ALGORITHMS|RECIPES|DESIGN|STYLE)\.md\b")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _files() if p.name != "test_docs.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert not hits, hits
