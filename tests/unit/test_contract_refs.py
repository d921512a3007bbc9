"""Every reference to the contract resolves to docs/contract.md, and none points outside the project (issue 48).

The code, the tests, the chart and the bench cite the contract's sections as "SPEC 5", "SPEC 6.3", "SPEC 5 R4"
or "contract section 8.1"; each must be a heading (or a rule) of docs/contract.md. The pages must link them
(`[SPEC 5](contract.md#5-rules)`), to the heading of that very section. `--help` says "contract section N".
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "docs" / "contract.md"
NUMBER = r"\d+(?:\.\d+)?"
# "SPEC 5", "SPEC 6.1 to 6.3", "SPEC 5, 6.3", "SPEC 4-6", "SPEC 5 S3, R1", "SPEC R5"; "contract section(s) 2.1"
PART = rf"(?:{NUMBER}|[RS]\d+)"
REF = re.compile(rf"\b(?:SPEC|contract sections?) ({PART}(?:(?:, | to |-| and | ){PART}\b)*)")
LINKED = re.compile(rf"\[SPEC ({NUMBER})\]\(([^)#\s]*contract\.md)#([\w-]+)\)")
OUTSIDE = ("SPEC.md", "../shared", "/work/shared")
TEXT = (".py", ".md", ".yaml", ".yml", ".tpl", ".toml", ".txt", ".cfg", ".json", ".sh", "Makefile", "Dockerfile")


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _sections() -> dict[str, str]:
    """Section number -> its heading's anchor, from the page itself."""
    found = {}
    for m in re.finditer(rf"(?m)^#{{2,3}} ({NUMBER})\.? (.*)$", CONTRACT.read_text()):
        found[m.group(1)] = _slug(m.group(0).lstrip("#").strip())
    return found


def _rules() -> set[str]:
    return set(re.findall(r"(?m)^- \*\*([RS]\d+)\.\*\*", CONTRACT.read_text()))


def _files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    here = Path(__file__).relative_to(ROOT).as_posix()  # its own examples of wrong references
    return [ROOT / f for f in listed if f.endswith(TEXT) and f != here and (ROOT / f).is_file()]


def _unresolved(text: str) -> list[str]:
    sections, rules = _sections(), _rules()
    bad = []
    for m in REF.finditer(text):
        for part in re.findall(rf"{NUMBER}|[RS]\d+", m.group(1)):
            known = rules if part[0] in "RS" else sections
            if part not in known:
                bad.append(f"{m.group(0)!r} ({part} is no section or rule of docs/contract.md)")
    return bad


def test_the_contract_has_every_section_and_rule():
    assert set(_sections()) == {"1", "2", "2.1", "3", "4", "5", "6", "6.1", "6.2", "6.3", "6.4", "7", "8", "8.1",
                                "8.2", "8.3", "9"}
    assert _rules() == {f"S{i}" for i in range(1, 7)} | {f"R{i}" for i in range(1, 9)}


def test_every_reference_in_the_project_resolves_to_the_contract():
    bad = []
    for path in _files():
        for problem in _unresolved(path.read_text(errors="replace")):
            bad.append(f"{path.relative_to(ROOT)}: {problem}")
    assert not bad, "\n".join(bad)


def test_no_reference_points_outside_the_project():
    bad = [f"{p.relative_to(ROOT)}: {needle}" for p in _files() for needle in OUTSIDE
           if needle in p.read_text(errors="replace")]
    assert not bad, "\n".join(bad)


def _pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]


def test_the_pages_link_every_spec_reference_to_its_section():
    """In the docs a reference is a link, to the heading of the section it names; a bare "SPEC" is not."""
    sections, bad = _sections(), []
    for page in _pages():
        text = page.read_text()
        for m in LINKED.finditer(text):
            number, target, anchor = m.groups()
            if (page.parent / target).resolve() != CONTRACT or sections.get(number) != anchor:
                bad.append(f"{page.relative_to(ROOT)}: {m.group(0)} (section {number} is #{sections.get(number)})")
        for line in LINKED.sub("", text).splitlines():
            if re.search(r"\bSPEC\b", line) and page != CONTRACT:
                bad.append(f"{page.relative_to(ROOT)}: unlinked SPEC in {line.strip()[:100]!r}")
    assert not bad, "\n".join(bad)


def test_links_to_the_contract_resolve():
    sections, bad = set(_sections().values()), []
    for page in _pages():
        for target, anchor in re.findall(r"\]\(([^)#\s]*contract\.md)#([^)\s]+)\)", page.read_text()):
            if (page.parent / target).resolve() == CONTRACT and anchor not in sections:
                bad.append(f"{page.relative_to(ROOT)}: contract.md#{anchor}")
    assert not bad, "\n".join(bad)


def _helps() -> list[tuple[str, str]]:
    from webhook.commands import flags

    found, todo = [], [flags.parser()]
    while todo:
        parser = todo.pop()
        found.append((parser.prog, parser.format_help()))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += action.choices.values()
    return found


def test_help_cites_the_contract_by_section():
    helps = _helps()
    assert len(helps) > 5
    assert any("contract section" in text for _, text in helps)
    bad = [f"{prog}: SPEC" for prog, text in helps if "SPEC" in text]
    bad += [f"{prog}: {problem}" for prog, text in helps for problem in _unresolved(text)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("text, ok", [("SPEC 6.3", True), ("SPEC 6.9", False), ("SPEC 5 R4", True),
                                      ("SPEC R9", False), ("contract section 10", False),
                                      ("SPEC 6.1 to 6.3", True), ("SPEC 4-12", False)])
def test_an_unknown_section_is_caught(text, ok):
    assert (not _unresolved(f"see ({text}) here")) is ok
