"""The docs match the code: the API reference is current, and every page the index links exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_is_current():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import generate_api
    finally:
        sys.path.pop(0)
    assert (ROOT / "docs" / "api.md").read_text() == generate_api.render(), "regenerate: python docs/generate_api.py"


def test_every_linked_doc_page_exists():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", page.read_text()):
            path = (ROOT / target) if page.name == "README.md" else (page.parent / target)
            assert path.is_file(), f"{page.name} links to {target}, which does not exist"


def test_readme_opens_with_the_two_commands():
    head = (ROOT / "README.md").read_text().split("```")[1]
    assert "make demo" in head and "make test" in head
    makefile = (ROOT / "Makefile").read_text()
    assert "examples/movielens.py" in makefile.split("demo:")[1].split("\n\n")[0]


def test_refusals_page_is_generated_from_the_list_the_matrix_reads():
    from sharders import refusals

    assert (ROOT / "docs" / "refusals.md").read_text() == refusals.markdown(), (
        "regenerate: python -m sharders.refusals > docs/refusals.md")
