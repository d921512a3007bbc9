"""The docs say what the code does: generated pages match it, links resolve, versions agree (issue 26).

That every rule id in the code is in the registry (the rules page's source) is tests/unit/test_registry.py's.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gen_docs  # noqa: E402

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """The ids MkDocs (and GitHub) give the page's headings: lower case, punctuation dropped, spaces to '-'."""
    found = set()
    for heading in re.findall(r"(?m)^#{1,6} (.+)$", markdown):
        text = re.sub(r"[^\w\- ]", "", heading.replace("`", "")).strip().lower()
        found.add(re.sub(r"\s+", "-", text))
    return found


def test_generated_pages_match_the_code():
    """`make docs` was run after the code changed: every page tools/gen_docs.py writes is as committed."""
    diffs = gen_docs.differences(chart=False)
    assert not diffs, "generated pages differ from the code (run `make docs`):\n" + "\n".join(diffs)[:6000]


def test_the_check_fails_when_a_page_drifts(tmp_path, monkeypatch):
    page = gen_docs.REFERENCE / "metrics.md"
    copy = tmp_path / "metrics.md"
    copy.write_text(page.read_text().replace("dispatch_admission_reviews_total", "dispatch_admission_reviews"))
    monkeypatch.setattr(gen_docs, "REFERENCE", tmp_path)
    for name in ("settings.md", "errors.md", "cli.md"):
        (tmp_path / name).write_text((page.parent / name).read_text())
    diffs = gen_docs.differences(chart=False)
    assert len(diffs) == 1 and "metrics.md" in diffs[0] and "+| `dispatch_admission_reviews_total`" in diffs[0]


def test_one_version_everywhere():
    """pyproject.toml holds the version; the package, the chart and the changelog agree with it."""
    from webhook import __version__

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((ROOT / "charts/dispatch-admission/Chart.yaml").read_text())
    assert __version__ == version
    assert (chart["version"], chart["appVersion"]) == (version, version)
    releases = re.findall(r"(?m)^## \[?(\d+\.\d+\.\d+[^\] ]*)\]? - \d{4}-\d{2}-\d{2}$",
                          (ROOT / "CHANGELOG.md").read_text())
    assert releases and releases[0] == version, f"CHANGELOG.md's latest release {releases[:1]} is not {version}"


def test_readme_is_short_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = LINK.findall(readme)
    assert len(links) >= 10
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target, _, anchor = link.partition("#")
        path = ROOT / target
        assert path.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(path.read_text()), f"README.md links to {link}: no such heading"


def test_every_page_is_in_the_nav():
    """mkdocs --strict fails on this too; here it names the page without building the site."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(items):
        for item in items:
            for value in item.values():
                yield from (pages(value) if isinstance(value, list) else [value])

    listed = set(pages(nav))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert listed == on_disk
