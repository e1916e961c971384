"""The README stays one page, and every page it links to exists (its reference material lives in docs/)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 230  # one page: the reference moves to docs/, one line and a link per topic here


def test_readme_is_one_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"


def test_readme_links_resolve():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    assert local, "the README links no page"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
