"""The chart's README.md is what helm-docs (built from its Go module) makes from values.yaml (issue 26)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gen_docs  # noqa: E402

CHART_FILES = {gen_docs.CHART / "README.md", gen_docs.CHART / "Chart.yaml", gen_docs.REFERENCE / "chart-values.md"}


def test_chart_readme_and_version_are_what_the_generator_makes():
    pages = gen_docs.pages(chart=True)
    assert CHART_FILES <= set(pages)
    stale = [str(p.relative_to(ROOT)) for p in CHART_FILES if p.read_text() != pages[p]]
    assert not stale, f"{stale} differ from helm-docs over values.yaml and the package version: run `make docs`"


def test_every_value_has_a_description():
    """A value without a `# --` comment gets an empty cell: the chart's README would not say what it does."""
    readme = (gen_docs.CHART / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ") and not line.startswith("| Key")]
    assert len(rows) > 50
    bare = [row.split(" | ")[0] for row in rows if row.rstrip().endswith("|  |")]
    assert not bare, f"values without a description in values.yaml: {bare}"
