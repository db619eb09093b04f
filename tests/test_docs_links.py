"""Every relative link in the README and the docs resolves, and perf/results/README.md indexes every committed result."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(md: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", md.read_text(encoding="utf-8")))
    return _LINK.findall(text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("md", [d for d in DOCS if d.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    bad = []
    for target in _links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    assert not bad, f"{md.relative_to(ROOT)}: broken links:\n  " + "\n  ".join(bad)


def test_results_index_lists_every_file():
    index = RESULTS / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in _links(index)}
    files = {p.resolve() for p in RESULTS.rglob("*") if p.is_file() and p != index}
    missing = sorted(str(p.relative_to(RESULTS)) for p in files - linked)
    assert not missing, "perf/results/README.md does not list: " + ", ".join(missing)


def test_no_binary_results():
    binaries = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")
                      if p.is_file() and p.suffix in (".ncu-rep", ".nsys-rep", ".png", ".bin"))
    assert not binaries, "binary files under perf/results (commit the text they were read from): " + ", ".join(binaries)
