"""The documentation site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a broken link, a missing
page or anchor, or a docstring mkdocstrings cannot read fails it; and the README stays a short entry point
whose links to the docs pages resolve."""
import os
import re
import subprocess
import sys

import pytest
from optional import needs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
README_MAX_LINES = 150
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")           # [text](target)


@pytest.mark.slow
@needs("mkdocs", reason="the docs build needs MkDocs (pip install -e '.[test]')")
def test_docs_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert os.path.isfile(tmp_path / "site" / "reference" / "cli" / "index.html")


def test_readme_is_short_and_its_doc_links_exist():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; the details belong in docs/"
    targets = [t.split("#", 1)[0] for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]
    pages = [t for t in targets if t.endswith(".md")]
    assert pages, "the README links no docs page"
    missing = [t for t in pages if not os.path.isfile(os.path.join(ROOT, t))]
    assert not missing, f"README.md links pages that do not exist: {missing}"
