"""README.md, CHANGELOG.md, docs/**/*.md: each relative Markdown link names a file that exists, each #anchor a heading.

Anchors follow GitHub's heading slugs: the heading's text in lower case, punctuation other than '-' and '_' removed,
each space a '-', and a repeated slug numbered '-1', '-2', ... in the order the headings come.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets; the target may carry a "title"
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
MARKUP_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans removed."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, CODE_SPAN.sub("", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = MARKUP_LINK.sub(r"\1", heading).lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in "-_ ").replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page offers: its headings' slugs (repeats numbered as GitHub does) and HTML name/id anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link in the page's prose, inline and reference-style."""
    found = []
    for number, line in prose_lines(text):
        found += [(number, target) for target in INLINE_LINK.findall(line)]
        reference = REFERENCE_LINK.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return found


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of ``page``: a missing file, or an anchor its .md target lacks."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for number, target in links(text):
        if not target or is_external(target):
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if path_part.startswith("/") or not path.exists():
            problems.append(f"{where}: no file {path_part}")
        elif anchor and path.suffix == ".md" and unquote(anchor) not in anchors(path.read_text(encoding="utf-8")):
            problems.append(f"{where}: no heading with the anchor #{anchor} in {path.relative_to(root)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slugs_follow_githubs_rules() -> None:
    assert slug("The staleness metric") == "the-staleness-metric"
    assert slug("The schedule (K = 3)") == "the-schedule-k--3"
    assert slug("ResNet-20, K = 4: the momentum raise under SGD (2026-12-03) — worse, use `delay_momentum`") == (
        "resnet-20-k--4-the-momentum-raise-under-sgd-2026-12-03--worse-use-delay_momentum"
    )
    assert slug("GPT-2 (AdamW), K = 4: delay compensation") == "gpt-2-adamw-k--4-delay-compensation"
    assert slug("Links in [a heading](x.md)") == "links-in-a-heading"


def test_repeated_headings_are_numbered_and_code_is_not_a_heading() -> None:
    text = '# Notes\n\n## Notes\n\n```\n# not a heading\n```\n<a name="here"></a>\n'
    assert anchors(text) == {"notes", "notes-1", "here"}


def test_links_in_code_are_not_links_and_every_kind_of_link_is_found() -> None:
    text = (
        'See [a](a.md#x), ![b](b.png "title") and `[c](c.md)`.\n'
        "```\n[d](d.md)\n```\n"
        "[e]: e.md\n"
        "[f [g]](https://example.com)\n"
    )
    assert [target for _, target in links(text)] == ["a.md#x", "b.png", "e.md", "https://example.com"]


def test_a_missing_file_and_a_missing_anchor_are_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Present\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#present) [gone](missing.md) [bad](other.md#absent) [self](#top)\n# Top\n")
    problems = broken_links(page, tmp_path)
    assert len(problems) == 2
    assert "no file missing.md" in problems[0] and "no heading with the anchor #absent" in problems[1]


GUIDE_LINES = 420  # issue 43: each top-level guide answers first and stays short; evidence lives in docs/results/
README_LINES = 210


@pytest.mark.parametrize("guide", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_top_level_guides_are_short(guide: Path) -> None:
    lines = len(guide.read_text(encoding="utf-8").splitlines())
    assert lines <= GUIDE_LINES, f"{guide.name} has {lines} lines; move detail to a reference page or docs/results/"


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines"


def test_evidence_lives_under_results() -> None:
    """Only guides (.md) at docs/'s top; JSON, pictures, diffs and dated folders go under docs/results/<topic>/."""
    stray = [p.name for p in (ROOT / "docs").iterdir() if p.name != "results" and (p.is_dir() or p.suffix != ".md")]
    assert not stray, f"evidence at docs/'s top level: {stray}"


CELL_CHARS = 1000


@pytest.mark.parametrize("guide", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_guide_table_cells_are_short(guide: Path) -> None:
    """A table cell of thousands of characters belongs in prose or a section of its own."""
    long_cells = [
        f"{guide.name}:{number}: a cell of {len(cell)} characters"
        for number, line in prose_lines(guide.read_text(encoding="utf-8"))
        if line.lstrip().startswith("|")
        for cell in line.split("|")
        if len(cell) > CELL_CHARS
    ]
    assert not long_cells, "\n".join(long_cells)
