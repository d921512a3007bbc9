"""docs/cli.md's exit-code table, row by row: each row names the test that holds it true, and these are them."""

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import EXAMPLES, NOW_TEXT, ROOT, review, trainjob
from tests.unit.test_cli import ROUTE1, cli, runtime_args
from webhook.commands import cli as cli_mod

TRAINJOBS = EXAMPLES / "trainjobs"
ADMITTED = str(TRAINJOBS / "admitted-torch.yaml")
REFUSED = str(TRAINJOBS / "refused-s3-dispatch-env.yaml")
TABLE_ROW = re.compile(r"^\| (?P<command>[^|]+) \| (?P<exit>[\d, ]+) \| .* \| (?P<test>tests/\S+::\w+) \|$")


def _rows() -> list[dict]:
    text = (ROOT / "docs" / "cli.md").read_text()
    return [m.groupdict() for line in text.splitlines() if (m := TABLE_ROW.match(line))]


def test_every_row_of_the_exit_code_table_names_a_test_that_exists():
    rows = _rows()
    commands = {r["command"].strip("` ") for r in rows}
    # every command of the parser has a row (the table is the one place the exit codes are written)
    assert {"check", "review", "settings check", "settings schema", "audit", "verify", "serve", "keep",
            "certificates", "certs"} <= commands, commands
    for row in rows:
        path, name = row["test"].split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{row['test']} is not a test"


def test_every_command_exits_2_on_a_usage_error():
    for argv in (["check"], ["check", "--settings", ROUTE1, ADMITTED], ["review", "--bogus"], ["settings"],
                 ["audit"], ["verify", "--timeout", "0"], ["serve", "--workers", "0"], ["keep"], ["certificates"],
                 ["certs"], ["nonsense"]):
        got = cli(*argv)
        assert got.returncode == 2 and "usage:" in got.stderr and "Traceback" not in got.stderr, (argv, got.stderr)


def test_interrupted_exits_130(monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli_mod.HANDLERS, "settings_schema", interrupted)
    assert cli_mod.main(["settings", "schema"]) == 130


def test_a_closed_pipe_exits_141_quietly():
    """`settings schema | head -1`, `check --help | head`, `check ... | head`: no traceback, exit 141."""
    import os

    for argv, code in ((["settings", "schema"], 141), (["check", "--settings", ROUTE1, *runtime_args(), ADMITTED], 141),
                       (["check", "--help"], 0)):  # argparse drops what it cannot write of --help
        read, write = os.pipe()
        os.close(read)  # the reader has gone before the first write, as `head` may have
        try:
            got = subprocess.run([sys.executable, "-m", "webhook", *argv], stdout=write, stderr=subprocess.PIPE,
                                 text=True, timeout=60)
        finally:
            os.close(write)
        assert got.returncode == code and got.stderr == "", (argv, got.stderr)


def test_check_exits_0_when_every_trainjob_is_admitted():
    assert cli("check", "--settings", ROUTE1, *runtime_args(), ADMITTED, ADMITTED).returncode == 0
    warned = cli("check", "--settings", ROUTE1, *runtime_args(), "--enforcement", "warn", REFUSED)
    assert warned.returncode == 0 and "would deny: ErrInvalid" in warned.stderr


def test_check_exits_1_when_a_trainjob_is_denied():
    got = cli("check", "--settings", ROUTE1, *runtime_args(), ADMITTED, REFUSED)
    assert got.returncode == 1 and "TrainJob train-torch admitted" in got.stdout and "denied (422" in got.stdout


TRAINJOB = (TRAINJOBS / "admitted-torch.yaml").read_text()
DEPLOYMENT = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n"


@pytest.mark.parametrize("text,says", [
    ("", "nothing was judged: no TrainJob of trainer.kubeflow.org/v1alpha1 in the manifests (no document in them)"),
    ("---\n", "nothing was judged"),
    ("---\n---\n# a comment\n", "nothing was judged"),
    (DEPLOYMENT, "nothing was judged: no TrainJob of trainer.kubeflow.org/v1alpha1 in the manifests (1 other"
                 " document skipped)"),
    (TRAINJOB.replace("trainer.kubeflow.org/v1alpha1", "trainer.kubeflow.org/v1"),
     "not judged, of an apiVersion the webhook does not serve: TrainJob train-torch (MANIFEST document 1)"),
    (TRAINJOB.replace("trainer.kubeflow.org/v1alpha1", "kubeflow.org/v1"), "does not serve: TrainJob train-torch"),
    (TRAINJOB.replace("apiVersion: trainer.kubeflow.org/v1alpha1\n", ""), "does not serve: TrainJob train-torch"),
    # one TrainJob not served among admitted ones still fails the run
    (TRAINJOB + "---\n" + TRAINJOB.replace("v1alpha1", "v1"), "does not serve: TrainJob train-torch (MANIFEST"
                                                              " document 2)"),
    ("a: [", "MANIFEST: not YAML"),
    ("- a list\n", "nothing was judged"),
])
def test_check_exits_2_on_what_it_cannot_judge(tmp_path, text, says):
    manifest = tmp_path / "m.yaml"
    manifest.write_text(text)
    got = cli("check", "--settings", ROUTE1, *runtime_args(), str(manifest))
    last = got.stderr.splitlines()[-1]
    assert got.returncode == 2 and last.startswith("dispatch-admission check: ")
    assert says.replace("MANIFEST", str(manifest)) in last, got.stderr


def test_check_exits_2_on_unusable_files(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    for argv, says in (([missing], f"{missing}: no such file"),
                       (["--settings", missing, ADMITTED], f"--settings {missing}: no such file"),
                       (["--runtime", missing, ADMITTED], f"runtime {missing}: no such file"),
                       ([str(tmp_path)], f"{tmp_path}: is a directory, not a file"),
                       (["--settings", str(EXAMPLES / "settings" / "invalid.json"), ADMITTED], "ErrInvalid"),
                       (["-", "-"], "stdin ('-') is named more than once")):
        settings = [] if "--settings" in argv else ["--settings", ROUTE1]
        got = cli("check", *settings, *runtime_args(), *argv, stdin="")
        assert got.returncode == 2 and says in got.stderr and got.stderr.count("\n") == 1, (argv, got.stderr)


def test_check_refuses_a_yaml_alias_bomb_before_expanding_it(tmp_path):
    """Nested anchors (a "billion laughs") expanded to gigabytes as the rules walked them: a CI runner hung. A
    document is measured with its aliases expanded, on the composed graph, before it is built; ordinary anchors
    still work, as kubectl takes them."""
    levels = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9))
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(TRAINJOB.replace("spec:\n", f"l0: &l0 [{'x' * 32}]\n{levels}spec:\n  extra: *l8\n", 1))
    got = cli("check", "--settings", ROUTE1, *runtime_args(), str(bomb))
    assert got.returncode == 2, got.stdout[-300:] + got.stderr
    assert "comes to more than 3145728 bytes with its YAML aliases expanded" in got.stderr, got.stderr
    anchored = tmp_path / "anchored.yaml"
    anchored.write_text(TRAINJOB.replace("  namespace: team-a\n",
                                         "  namespace: team-a\n  labels: &l {team: a}\n  annotations: *l\n", 1))
    assert cli("check", "--settings", ROUTE1, *runtime_args(), str(anchored)).returncode == 0


def test_dash_is_stdin_wherever_a_file_is_taken(tmp_path):
    runtime = (EXAMPLES / "runtimes" / "torch-distributed.yaml").read_text()
    settings = (EXAMPLES / "settings" / "route1.json").read_text()
    assert "stdin: TrainJob train-torch admitted" in cli("check", "--settings", ROUTE1, *runtime_args(), "-",
                                                         stdin=TRAINJOB).stdout
    assert cli("check", "--settings", "-", *runtime_args(), ADMITTED, stdin=settings).returncode == 0
    assert cli("check", "--settings", ROUTE1, "--runtime", "-", ADMITTED, stdin=runtime).returncode == 0
    assert cli("settings", "check", "-", stdin=settings).stdout == "stdin: valid\n"
    assert cli("settings", "check", "-", stdin="{").returncode == 1
    got = cli("review", "--settings", "-", *runtime_args(), stdin=json.dumps(review(trainjob())))
    assert got.returncode == 2 and "stdin ('-') is named more than once" in got.stderr
    file = tmp_path / "review.json"
    file.write_text(json.dumps(review(trainjob())))
    got = cli("review", "--settings", "-", *runtime_args(), str(file), stdin=settings)
    assert got.returncode == 0 and json.loads(got.stdout)["response"]["uid"] == "uid-1", got.stderr
    got = cli("review", "--settings", ROUTE1, *runtime_args(), str(tmp_path / "missing.json"))
    assert got.returncode == 2 and got.stderr.endswith(f"{tmp_path}/missing.json: no such file\n")


def test_review_exits_0_allowed_or_denied():
    doc = json.dumps(review(trainjob(runtime_name="torch-distributed")))
    allowed = cli("review", "--settings", ROUTE1, *runtime_args(), "--now", NOW_TEXT, stdin=doc)
    denied = cli("review", "--settings", ROUTE1, *runtime_args(), "--validate", stdin=doc)
    assert allowed.returncode == denied.returncode == 0
    assert json.loads(allowed.stdout)["response"]["allowed"] and not json.loads(denied.stdout)["response"]["allowed"]


def test_settings_check_exit_codes(tmp_path):
    assert cli("settings", "check", ROUTE1).returncode == 0
    invalid = cli("settings", "check", str(EXAMPLES / "settings" / "invalid.json"))
    assert invalid.returncode == 1 and invalid.stderr.startswith("ErrInvalid: ")
    missing = cli("settings", "check", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and missing.stderr == f"dispatch-admission settings: {tmp_path}/nope.json: no such" \
                                                         " file\n"


def test_settings_schema_exits_0():
    got = cli("settings", "schema")
    assert got.returncode == 0 and json.loads(got.stdout)["additionalProperties"] is False


def test_audit_exit_zero_turns_findings_into_0(monkeypatch, tmp_path):
    from webhook.commands import audit

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("{}")
    for found, flags, want in ((0, [], 0), (1, [], 1), (1, ["--exit-zero"], 0)):
        monkeypatch.setattr(audit, "run", lambda *a, found=found, **kw: found)
        assert cli_mod.main(["audit", "--settings", ROUTE1, "--kubeconfig", str(kubeconfig), *flags]) == want


def _no_cluster(monkeypatch):
    """Any attempt at a cluster fails the test: these refusals come before any call."""
    import webhook.kube.client as client

    def contacted(*a, **kw):
        raise AssertionError("the cluster was contacted")

    monkeypatch.setattr(client, "api_client", contacted)


def test_audit_exits_2_before_any_call(monkeypatch, capsys, tmp_path):
    _no_cluster(monkeypatch)
    assert cli_mod.main(["audit", "--settings", ROUTE1, "--kubeconfig", "/nonexistent"]) == 2
    assert capsys.readouterr().err == "dispatch-admission audit: --kubeconfig /nonexistent: no such file\n"
    assert cli_mod.main(["audit", "--settings", str(tmp_path / "s.json")]) == 2
    assert f"--settings {tmp_path}/s.json: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--runtime", "Foo_Bar"], "--runtime 'Foo_Bar': 'Foo_Bar' is not a Kubernetes object name"),
    (["--runtime", "Deployment/x"], "--runtime 'Deployment/x': expected KIND/NAME"),
    (["--runtime", "torch", "--namespace", "Team A"], "--namespace 'Team A' is not a namespace name"),
    (["--runtime", "torch", "--kubeconfig", "/nonexistent"], "--kubeconfig /nonexistent: no such file"),
    (["--runtime", "torch", "--settings", "/nonexistent"], "--settings /nonexistent: no such file"),
    (["--cleanup", "--kubeconfig", "/nonexistent"], "--kubeconfig /nonexistent: no such file"),
])
def test_verify_exits_2_before_any_call(monkeypatch, capsys, argv, says):
    _no_cluster(monkeypatch)
    from webhook.kube import verify_cluster

    monkeypatch.setattr(verify_cluster.Cluster, "__init__", lambda *a, **kw: pytest.fail("the cluster was contacted"))
    assert cli_mod.main(["verify", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_serve_exits_1_when_what_it_was_given_cannot_be_served(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"publish": {"image": "publish:v1"}}')
    for argv in (["--settings", str(bad)], ["--settings", str(tmp_path / "missing.json")],
                 ["--settings", ROUTE1, "--cert-dir", str(tmp_path)]):
        got = subprocess.run([sys.executable, "-m", "webhook", "serve", *argv, "--bind", "127.0.0.1:0",
                              *runtime_args()], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert got.returncode == 1 and "Traceback" not in got.stderr, (argv, got.stderr[-2000:])


def test_certificates_once_exits_2_when_the_sync_fails(tmp_path):
    from tests.process import unanswered_kubeconfig

    got = cli("certificates", "--once", "--namespace", "ns", "--tls-secret", "tls", "--ca-secret", "ca",
              "--tls-service", "svc", "--webhook-configuration", "wh",
              "--kubeconfig", unanswered_kubeconfig(tmp_path / "kubeconfig"))
    # the client's retries are logged before it (the controller logs at info)
    assert got.returncode == 2 and got.stderr.splitlines()[-1].startswith("dispatch-admission certificates: ")


def test_certs_exits_2_when_out_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    got = cli("certs", "--service", "s", "--namespace", "n", "--out", str(blocker / "dir"))
    assert got.returncode == 2 and f"--out {blocker}/dir: cannot write" in got.stderr and "Traceback" not in got.stderr


def test_every_argument_is_described_in_help():
    import argparse

    def undescribed(p: argparse.ArgumentParser, name: str):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    yield from undescribed(sp, f"{name} {sub}")
            elif not a.help:
                yield f"{name} {'/'.join(a.option_strings) or a.dest}"

    assert list(undescribed(cli_mod.parser(), "dispatch-admission")) == []
    for command in ("check", "review"):
        text = cli(command, "--help").stdout
        assert "--settings FILE" in text and "--runtime FILE" in text and "- for stdin" in text
    assert "the settings JSON file, or - for stdin" in cli("settings", "check", "--help").stdout
