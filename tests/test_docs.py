"""README.md and docs/: every relative link points at a file that exists and, where it
names a section, at a heading that file has (GitHub's anchors)."""

import re
from pathlib import Path

import pytest

from tests.runs import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor(m[1]) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return [m[1] for m in LINK.finditer(FENCE.sub("", page.read_text()))]


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, section = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target} (no such file)")
        elif section and file.suffix == ".md" and section not in anchors(file):
            bad.append(f"{target} (no such section)")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    assert broken(page) == []


def test_the_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A section\n")
    page.write_text(
        "# Top\n[ok](there.md#a-section) [ok](#top) [gone](missing.md) [no](there.md#b)\n"
        "```\n[in code](not/checked.md)\n```\n"
    )
    assert broken(page) == ["missing.md (no such file)", "there.md#b (no such section)"]


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250 and "## Contents" in lines
