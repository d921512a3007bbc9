"""The commands the docs show, run, and their output compared: the docs cannot drift from the program (issue 48).

The convention (CONTRIBUTING.md says it too):
- A command and its output are shown in a ```console block: each command on a line starting with `$ ` (a line
  ending in `\\` continues it), followed by exactly what it prints, stdout and stderr together. Every fenced block
  holding a `$ ` line must be a console block.
- Each console block is run here, command by command, with `bash` from the repository's root and the venv's
  `dispatch-admission` first on PATH, and its output compared exactly. Only offline commands run (`check`,
  `review`, `settings`, `certs`, and a few shell tools after them in a pipe); a block that needs a cluster is
  marked on the line before its fence with `<!-- not-run: REASON -->`, and counted in NOT_RUN below, so a new
  one is seen in review.
- The one normalisation: `/tmp/dispatch-docs` in a command is a fresh temporary directory, written back as
  `/tmp/dispatch-docs` in the output. Nothing else is rewritten.
- A ```pycon block (the Python API) is run as a doctest from the repository's root.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
TMP_IN_DOCS = "/tmp/dispatch-docs"
FENCE = re.compile(r"(?m)^(?:(?P<marker><!-- not-run: (?P<why>[^>]+?) -->)\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)^```$",
                   re.S)
# What a run block may call: the CLI's offline commands, then simple filters in a pipe.
OFFLINE = {"check", "review", "settings", "certs", "--help", "--version"}
FILTERS = {"head", "tail", "grep", "sort", "wc", "cut", "ls", "cat", "base64", "python3", "jq", "tr"}

# The blocks marked not-run, per page: a new one must be added here (and so be seen in review).
NOT_RUN = {
    "README.md": 1,
    "docs/debugging.md": 2,
    "docs/getting-started.md": 1,
    "docs/hardening.md": 1,
    "docs/rollout.md": 2,
    "docs/verify.md": 13,
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str
    not_run: str  # why it is not run; "" when it is

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path, text: str | None = None) -> list[Block]:
    text = page.read_text() if text is None else text
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start("lang")) + 1
        found.append(Block(page, line, m.group("lang"), m.group("body"), m.group("why") or ""))
    return found


def session(body: str) -> list[tuple[str, str]]:
    """A console block as (command, expected output) pairs."""
    pairs: list[tuple[str, list[str]]] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            if not pairs:
                raise ValueError(f"a console block must start with a `$ ` command, not {lines[i]!r}")
            pairs[-1][1].append(lines[i])
            i += 1
            continue
        command = [lines[i][2:]]
        while command[-1].endswith("\\") and i + 1 < len(lines):
            i += 1
            command.append(lines[i])
        pairs.append(("\n".join(command), []))
        i += 1
    return [(cmd, "\n".join(out)) for cmd, out in pairs]


def offline_problem(command: str) -> str:
    """Why this command may not run here ("" when it may): only the CLI's offline commands, then filters."""
    for part in re.split(r"\|\|?|&&|;", command.replace("\\\n", " ")):
        words = shlex.split(part)
        if not words:
            continue
        if words[0] == "dispatch-admission":
            sub = next((w for w in words[1:] if not w.startswith("-") or w in OFFLINE), "")
            if sub not in OFFLINE:
                return f"`dispatch-admission {sub}` is not an offline command: mark the block not-run"
        elif words[0] not in FILTERS:
            return f"`{words[0]}` may not run here: mark the block not-run"
    return ""


def run(command: str, tmp: Path) -> str:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", COLUMNS="120", NO_COLOR="1")
    proc = subprocess.run(["bash", "-c", command.replace(TMP_IN_DOCS, str(tmp))], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    return proc.stdout.replace(str(tmp), TMP_IN_DOCS).rstrip("\n")


def differences(block: Block, tmp: Path) -> list[str]:
    """What differs between the block's shown output and the program's, command by command."""
    found = []
    for command, expected in session(block.body):
        problem = offline_problem(command)
        if problem:
            found.append(f"{block}: {problem}")
            continue
        actual = run(command, tmp)
        if actual != expected:
            found.append(f"{block}: `$ {command}` printed\n{actual}\n--- but the page shows ---\n{expected}")
    return found


def pycon_failures(block: Block) -> str:
    """The doctest of a pycon block, run from the repository's root: its report, "" when it passes."""
    test = doctest.DocTestParser().get_doctest(block.body, {}, str(block), str(block.page), block.line)
    out: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        runner.run(test, out=out.append)
    finally:
        os.chdir(cwd)
    return "".join(out) if runner.failures else ""


def _all() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


RUN = [b for b in _all() if b.lang == "console" and not b.not_run]


@pytest.mark.parametrize("block", RUN, ids=str)
def test_the_command_prints_what_the_page_shows(block, tmp_path):
    found = differences(block, tmp_path)
    assert not found, "\n\n".join(found)


@pytest.mark.parametrize("block", [b for b in _all() if b.lang == "pycon"], ids=str)
def test_the_python_example_runs_as_shown(block):
    report = pycon_failures(block)
    assert not report, report


def test_what_is_run_covers_the_pages_that_show_commands():
    pages = {b.page.relative_to(ROOT).as_posix() for b in RUN}
    assert {"README.md", "docs/getting-started.md", "docs/settings.md", "docs/troubleshooting.md",
            "docs/faq.md"} <= pages
    assert any(b.lang == "pycon" and b.page.name == "getting-started.md" for b in _all())


def test_every_command_with_output_is_in_a_console_block():
    """A `$ ` line outside a console block would be shown and never run."""
    bad = [f"{b} (```{b.lang})" for b in _all() if b.lang != "console" and re.search(r"(?m)^\$ ", b.body)]
    assert not bad, "show commands in ```console blocks:\n" + "\n".join(bad)


def test_the_blocks_not_run_are_the_listed_ones():
    """Each block not run is counted here per page, and has a reason; a marker must sit on a console block."""
    counted: dict[str, int] = {}
    for b in _all():
        if b.not_run:
            assert b.lang == "console", f"{b}: a not-run marker on a ```{b.lang} block"
            assert len(b.not_run.strip()) > 5, f"{b}: say why it is not run"
            counted[b.page.relative_to(ROOT).as_posix()] = counted.get(b.page.relative_to(ROOT).as_posix(), 0) + 1
    assert counted == NOT_RUN


# ---- the check itself fails when a page drifts ----

def _one_block(text: str) -> Block:
    (block,) = [b for b in blocks(ROOT / "docs" / "settings.md", text) if b.lang == "console"]
    return block


def test_an_edited_output_fails(tmp_path):
    page = (ROOT / "docs" / "settings.md").read_text()
    assert not differences(_one_block(page), tmp_path)
    edited = page.replace("references a tag, not a digest", "references a tag, not a digets", 1)
    assert edited != page
    found = differences(_one_block(edited), tmp_path)
    assert len(found) == 1 and "not a digets" in found[0] and "not a digest" in found[0]


def test_a_missing_output_line_fails(tmp_path):
    block = Block(ROOT / "README.md", 1, "console", "$ dispatch-admission settings check "
                  "examples/settings/route1.json\n", "")
    (found,) = differences(block, tmp_path)
    assert "examples/settings/route1.json: valid" in found


def test_an_edited_python_example_fails():
    (block,) = [b for b in blocks(ROOT / "docs" / "getting-started.md") if b.lang == "pycon"]
    assert not pycon_failures(block)
    edited = Block(block.page, block.line, "pycon", block.body.replace("(False, 422, 'Invalid')",
                                                                     "(False, 403, 'Invalid')"), "")
    assert "Expected:" in pycon_failures(edited)


def test_a_cluster_command_is_not_run():
    assert "not-run" in offline_problem("kubectl apply -f x.yaml")
    assert "not an offline command" in offline_problem("dispatch-admission serve --dev")
    assert "not an offline command" in offline_problem("dispatch-admission --settings s.json verify --runtime x")
    assert offline_problem("dispatch-admission settings schema | head -3") == ""
    assert "may not run" in offline_problem("dispatch-admission check a.yaml && curl https://x")


def test_the_session_reads_continued_commands():
    assert session("$ a \\\n    b\nout 1\nout 2\n$ c\n") == [("a \\\n    b", "out 1\nout 2"), ("c", "")]
    with pytest.raises(ValueError):
        session("output first\n$ a\n")


def test_the_tmp_path_is_the_only_normalisation(tmp_path):
    block = Block(ROOT / "README.md", 1, "console", f"$ ls {TMP_IN_DOCS}/x 2>&1 | cut -d: -f2-\n"
                  f" cannot access '{TMP_IN_DOCS}/x': No such file or directory\n", "")
    assert not differences(block, tmp_path)
