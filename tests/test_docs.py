"""The docs hold together: every link from README.md and docs/*.md to a file of the repository resolves, every
recorded result in bench/results is cited by README.md or docs/performance.md (the rest live in the git history,
docs/kernel-log.md says where), and the README stays a front door for users."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def local_links(doc: Path) -> list[str]:
    """The targets of the markdown links of `doc` that point into the repository (no URLs, no bare anchors)."""
    targets = [m.group(1) for m in LINK.finditer(doc.read_text())]
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_link_to_a_repository_file_resolves(doc):
    missing = [t for t in local_links(doc) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to files that do not exist: {missing}"


def test_every_recorded_result_is_cited_by_the_readme_or_the_performance_page():
    cited = (REPO / "README.md").read_text() + (REPO / "docs" / "performance.md").read_text()
    results = sorted(p.name for p in (REPO / "bench" / "results").iterdir())
    assert len(results) <= 40
    assert [name for name in results if f"bench/results/{name}" not in cited] == []


def test_the_readme_is_for_users():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert ".ci/run" in text  # the test command
    assert "docs/performance.md" in text
    # history lives in docs/kernel-log.md and the git log
    assert not re.search(r"\b(first|second|third|[a-z]+th|[a-z]+teenth) session\b", text)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)


def test_no_archives_or_path_patches_on_main():
    assert not list((REPO / "docs").rglob("*.patch"))
    patched = [p.name for p in (REPO / "bench").rglob("*.py") if "sys.path" in p.read_text()]
    assert patched == []
