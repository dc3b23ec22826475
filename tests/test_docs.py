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


def exit_code_rows() -> list[tuple[str, list[str]]]:
    """(exit code, the tests named) of each row of docs/faults.md's exit-code table."""
    text = (ROOT / "docs" / "faults.md").read_text()
    table = text.split("## Exit codes", 1)[1].split("\n\n| exit |", 1)[1].split("\n\n")[0]
    rows = [r.split("|") for r in table.splitlines() if r.startswith("| ") and "---" not in r]
    return [(r[1].strip(), re.findall(r"`(tests/[\w/]+\.py::\w+)`", r[4])) for r in rows[1:]]


def test_every_exit_code_of_the_table_is_asserted_by_the_tests_it_names():
    rows = exit_code_rows()
    assert {code for code, _ in rows} == {"0", "1", "2", "75", "130", "134"}
    for code, tests in rows:
        assert tests, f"exit {code}: no test named"
        for test in tests:
            path, name = test.split("::")
            source = (ROOT / path).read_text()
            assert f"def {name}(" in source, test
            body = source.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]
            assert re.search(rf"\b{code}\b", body), f"{test} asserts nothing of exit {code}"


def test_every_test_the_docs_name_exists():
    named = {m for page in PAGES for m in re.findall(r"(tests/[\w/]+\.py::\w+)", page.read_text())}
    assert named
    missing = [
        t
        for t in sorted(named)
        if f"def {t.split('::')[1]}(" not in (ROOT / t.split("::")[0]).read_text()
    ]
    assert missing == []
