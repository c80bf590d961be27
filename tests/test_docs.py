"""The documentation: the site builds strictly, and nothing points outside the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.timeout(300)
def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the nav exists, every link and anchor resolves,
    every API reference block renders."""
    done = subprocess.run(
        # Not --quiet: it hides the warnings that --strict turns into a failure.
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "python-api" / "index.html").is_file()


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_documents_stand_alone(document: Path) -> None:
    """A user's checkout has no ``../shared``: no document may send a reader there."""
    text = document.read_text()
    assert "../shared" not in text and "/work/" not in text


def test_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target
    for path in re.findall(r"`(docs/[^`\s]+\.md)`", readme):
        assert (ROOT / path).exists(), path
