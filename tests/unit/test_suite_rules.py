"""The suite's own rules (issue 49): one waiter, one kubectl helper.

- A loop that sleeps is a wait, and a wait is `tests/helpers.py`'s `eventually` (or `tests/process.py`'s
  `started_ready`, eventually for a process we started): no hand-written deadline or retry loop beside it. The
  loops that sleep for another reason (a load paced at a rate, a figure they time themselves) are listed below,
  each with why, and say so in a comment where they stand.
- kubectl runs through `ControlPlane.kubectl` (or `kubectl_follow`, for one that runs on): no test builds a
  kubectl command line of its own.
"""

from __future__ import annotations

import ast

from tests.helpers import ROOT

TESTS = ROOT / "tests"

# (file, the function the loop is in): why it sleeps without being a wait.
SLEEPING_LOOPS = {
    ("tests/helpers.py", "eventually"): "the waiter itself",
    ("tests/e2e/test_install.py", "one"): "the hostile tenant's dry-run flood, paced at its rate",
    ("tests/e2e/test_install.py", "watch"): "times when each object goes during the uninstall (a figure)",
    ("tests/e2e/test_kueue.py", "test_preempted_job_whose_runtime_was_edited_or_deleted"):
        "lets Kueue act for the report, after each wait",
    ("tests/e2e/test_metrics_auth.py", "reviews"): "reviews for a while, each timed (a figure)",
    ("tests/e2e/test_metrics_auth.py", "scraper"): "Prometheus' scrape every half second (load)",
    ("tests/server/test_body_in_flight.py", "test_the_room_counts_bytes_received_and_comes_back_exactly"):
        "clients that go away mid-body, each read for a moment first",
    ("tests/server/test_held_bytes.py", "reviewer"): "an API server's steady flow, each review timed (a figure)",
    ("tests/server/test_server.py", "test_certificate_rotation_without_failed_requests"):
        "rotations spaced under load (load)",
    ("tests/server/test_slow_clients.py", "client"): "reviews paced at a rate, each timed (a figure)",
}
# The one place a kubectl command line is built.
KUBECTL_HELPER = "tests/e2e/cluster.py"


def _sources() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text(), str(p))) for p in sorted(TESTS.rglob("*.py"))]


def _sleeps(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) in ("time.sleep", "sleep") for n in ast.walk(node))


def sleeping_loops(tree: ast.Module) -> set[tuple[str, int]]:
    """(the innermost function, line) of every loop that sleeps."""
    found = set()

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.While | ast.For) and _sleeps(child):
                found.add((inner, child.lineno))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def raw_kubectl(tree: ast.Module) -> list[int]:
    """Lines that build a kubectl command themselves: the binary's path (`kubectl_bin`, `bins["kubectl"]`) or a
    command list starting with "kubectl"."""
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr == "kubectl_bin":
            lines.append(n.lineno)
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "kubectl":
            lines.append(n.lineno)
        elif isinstance(n, ast.List | ast.Tuple) and n.elts and isinstance(n.elts[0], ast.Constant) \
                and isinstance(n.elts[0].value, str) and n.elts[0].value.split("/")[-1] == "kubectl":
            lines.append(n.lineno)
    return lines


def test_no_loop_sleeps_to_wait_beside_eventually():
    found = {(path, function): line for path, tree in _sources() for function, line in sleeping_loops(tree)}
    bare = sorted(f"{path}:{line} (in {function})" for (path, function), line in found.items()
                  if (path, function) not in SLEEPING_LOOPS)
    assert not bare, ("a loop that sleeps: wait with tests/helpers.py's eventually (tests/process.py's started_ready"
                      " for a process), or, if it paces a load or times a figure, add it to SLEEPING_LOOPS with"
                      f" why: {bare}")
    gone = sorted(set(SLEEPING_LOOPS) - set(found))
    assert not gone, f"listed in SLEEPING_LOOPS but no longer a loop that sleeps: {gone}"


def test_no_kubectl_command_line_beside_the_control_planes():
    found = sorted(f"{path}:{line}" for path, tree in _sources() if path != KUBECTL_HELPER
                   for line in raw_kubectl(tree))
    assert not found, f"kubectl run by hand: use ControlPlane.kubectl (or kubectl_follow): {found}"


def test_the_checks_find_what_they_look_for():
    """The two scans on a sample: a deadline loop, a retry loop, a loop in a method, and kubectl by hand."""
    sample = ast.parse(
        "def wait():\n"
        "    while time.monotonic() < deadline:\n"
        "        time.sleep(0.2)\n"
        "def retry():\n"
        "    for _ in range(5):\n"
        "        if send(): break\n"
        "        time.sleep(2)\n"
        "class C:\n"
        "    def method(self):\n"
        "        while True:\n"
        "            sleep(1)\n"
        "def fine():\n"
        "    for x in xs:\n"
        "        print(x)\n"
        "def kubectl():\n"
        "    subprocess.run(['kubectl', 'get', 'pods'])\n"
        "    subprocess.run([c.kubectl_bin, 'get', 'pods'])\n"
        "    subprocess.run([bins['kubectl'], 'get'])\n"
        "    c.kubectl('get', 'pods')\n")
    assert sleeping_loops(sample) == {("wait", 2), ("retry", 5), ("method", 10)}
    assert sorted(raw_kubectl(sample)) == [16, 17, 18]


def test_nothing_local_is_tracked():
    """What .gitignore keeps local (the venv, certificates, builds) is not in git, and no tracked symlink leads out
    of the checkout: a worktree's `.venv` symlink to another checkout's venv was committed once, and a clone's
    `make install` would have written through it."""
    import os
    import subprocess

    def git(*args: str) -> list[str]:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")

    ignored = [f for f in git("ls-files", "-z", "-ci", "--exclude-standard") if f]
    assert ignored == [], f"tracked, though .gitignore keeps them local: {ignored}"
    links = [line.split("\t", 1)[1] for line in git("ls-files", "-z", "-s") if line.startswith("120000 ")]
    outside = [f for f in links if not os.path.realpath(ROOT / f).startswith(str(ROOT.resolve()) + os.sep)]
    assert outside == [], f"tracked symlinks leading out of the checkout: {outside}"
