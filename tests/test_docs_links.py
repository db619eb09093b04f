"""Every relative link in the README and the docs resolves, perf/results/README.md indexes every committed result, and
the tool shelf stays small: perf/ holds at most 12 scripts, perf/results/ at most 40 files, each result cited by the
README or a doc."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "perf"
RESULTS = PERF / "results"
MAX_SCRIPTS = 12
MAX_RESULTS = 40
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


def test_perf_shelf_holds_at_most_12_scripts():
    scripts = sorted(p.name for p in PERF.iterdir() if p.is_file() and p.name != "README.md")
    assert len(scripts) <= MAX_SCRIPTS, (
        f"perf/ holds {len(scripts)} scripts, more than {MAX_SCRIPTS}: fold one into `specpilot` or delete it (its "
        f"findings stay in the docs' 'What was tried' tables): {scripts}")


def test_results_hold_at_most_40_files():
    files = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())
    assert len(files) <= MAX_RESULTS, (
        f"perf/results holds {len(files)} files (README.md included), more than {MAX_RESULTS}: retire a run (its "
        f"figure into the doc's findings table, the file named there without a link, then deleted)")


def test_every_result_is_cited_by_the_readme_or_a_doc():
    """A link from README.md or docs/*.md, or the path perf/results/<file> written out there (e.g. in a command)."""
    cited, text = set(), ""
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        cited |= {(md.parent / t.partition("#")[0]).resolve() for t in _links(md)}
        text += md.read_text(encoding="utf-8")
    uncited = []
    for p in sorted(RESULTS.rglob("*")):
        rel = p.relative_to(RESULTS).as_posix()
        if p.is_file() and rel != "README.md" and p.resolve() not in cited and f"perf/results/{rel}" not in text:
            uncited.append(rel)
    assert not uncited, "perf/results files cited by neither README.md nor docs/*.md: " + ", ".join(uncited)
