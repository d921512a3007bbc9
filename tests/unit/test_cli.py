"""The offline CLI, run as a user runs it: the console script in a subprocess."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, MANAGER, NOW_TEXT, review, trainjob

RUNTIMES = sorted(str(p) for p in (EXAMPLES / "runtimes").glob("*.yaml"))
ROUTE1 = str(EXAMPLES / "settings" / "route1.json")
ROUTE2 = str(EXAMPLES / "settings" / "route2.json")


def cli(*args, stdin=None, cwd=None):
    exe = shutil.which("dispatch-admission", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "webhook"]
    return subprocess.run(cmd + list(args), input=stdin, capture_output=True, text=True, timeout=60, cwd=cwd)


def runtime_args():
    return [a for r in RUNTIMES for a in ("--runtime", r)]


@pytest.mark.parametrize("manifest", sorted((EXAMPLES / "trainjobs").glob("*.yaml")), ids=lambda p: p.name)
def test_check_examples(manifest):
    settings = ROUTE2 if "route2" in manifest.name else ROUTE1
    got = cli("check", "--settings", settings, *runtime_args(), "--now", NOW_TEXT, str(manifest))
    if manifest.name.startswith("admitted"):
        assert got.returncode == 0, got.stdout + got.stderr
        assert "admitted" in got.stdout and MANAGER in got.stdout and NOW_TEXT in got.stdout
        assert "/opt/dispatch" in got.stdout
    else:
        assert got.returncode == 1, got.stdout + got.stderr
        assert "denied" in got.stdout and "  * spec." in got.stdout


def test_check_unusable_input(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [")
    assert cli("check", "--settings", ROUTE1, *runtime_args(), str(bad)).returncode == 2
    assert cli("check", "--settings", str(EXAMPLES / "settings" / "invalid.json"), *runtime_args(),
               str(EXAMPLES / "trainjobs" / "admitted-torch.yaml")).returncode == 2
    assert cli("check", "--settings", ROUTE1, "--runtime", str(bad), str(bad)).returncode == 2


def test_review_matches_mutate_and_validate():
    doc = json.dumps(review(trainjob(runtime_name="torch-distributed")))
    got = cli("review", "--settings", ROUTE1, *runtime_args(), "--now", NOW_TEXT, stdin=doc)
    assert got.returncode == 0, got.stderr
    resp = json.loads(got.stdout)["response"]
    assert resp["uid"] == "uid-1" and resp["allowed"] and resp["patchType"] == "JSONPatch"
    got = cli("review", "--settings", ROUTE1, *runtime_args(), "--validate", stdin=doc)
    resp = json.loads(got.stdout)["response"]
    assert got.returncode == 0 and resp["allowed"] is False and resp["status"]["code"] == 422


def test_review_is_reproducible_with_now():
    doc = json.dumps(review(trainjob()))
    a = cli("review", "--settings", ROUTE1, *runtime_args(), "--now", NOW_TEXT, stdin=doc).stdout
    b = cli("review", "--settings", ROUTE1, *runtime_args(), "--now", NOW_TEXT, stdin=doc).stdout
    assert a == b


@pytest.mark.parametrize("stdin",
                         ["not json", "[]", '{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}'])
def test_review_unusable_input_exits_2(stdin):
    got = cli("review", "--settings", ROUTE1, *runtime_args(), stdin=stdin)
    assert got.returncode == 2 and got.stderr and not got.stdout


def test_review_bad_now_exits_2():
    got = cli("review", "--settings", ROUTE1, *runtime_args(), "--now", "yesterday", stdin="{}")
    assert got.returncode == 2 and "--now" in got.stderr


def test_settings_check_and_schema():
    assert cli("settings", "check", ROUTE1).returncode == 0
    bad = cli("settings", "check", str(EXAMPLES / "settings" / "invalid.json"))
    assert bad.returncode == 1 and bad.stderr.startswith("ErrInvalid: ")
    assert "publish.image" in bad.stderr and "credentials[0].mountPath" in bad.stderr
    schema = json.loads(cli("settings", "schema").stdout)
    assert schema["additionalProperties"] is False


def test_python_dash_m_works():
    got = subprocess.run([sys.executable, "-m", "webhook", "settings", "check", ROUTE2], capture_output=True, text=True)
    assert got.returncode == 0


def test_certs_command(tmp_path):
    import stat

    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    got = cli("certs", "--service", "dispatch-admission", "--namespace", "dispatch-system", "--out", str(tmp_path))
    assert got.returncode == 0, got.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    for key in ("ca.key", "tls.key"):
        assert stat.S_IMODE((tmp_path / key).stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    leaf = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    ca.public_key().verify(leaf.signature, leaf.tbs_certificate_bytes, ec.ECDSA(leaf.signature_hash_algorithm))
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(san.get_values_for_type(x509.DNSName)) | {str(i) for i in san.get_values_for_type(x509.IPAddress)}
    assert {"dispatch-admission.dispatch-system.svc", "dispatch-admission.dispatch-system.svc.cluster.local",
            "localhost", "127.0.0.1"} <= names


def test_review_with_unusable_settings_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"manager": null}')
    got = cli("review", "--settings", str(bad), *runtime_args(), stdin=json.dumps(review(trainjob())))
    assert got.returncode == 2 and "ErrInvalid: manager" in got.stderr and not got.stdout


@pytest.mark.parametrize("flag", ["--max-body", "--max-body-in-flight", "--workers", "--read-timeout"])
def test_serve_sizes_and_counts_must_be_above_zero(flag):
    """A body cap, a worker count or a timeout of 0 or less would refuse every review: refused at the
    command line, naming the flag (exit 2), before anything starts."""
    for value in ("0", "-5"):
        got = subprocess.run([sys.executable, "-m", "webhook", "serve", flag, value], capture_output=True, text=True,
                             timeout=60)
        assert got.returncode == 2 and f"argument {flag}" in got.stderr and "is not above 0" in got.stderr, got.stderr


@pytest.mark.parametrize("flags", [["--bind", "127.0.0.1:9443", "--metrics-bind", "127.0.0.1:9443"],
                                   ["--bind", "0.0.0.0:9443", "--metrics-bind", "localhost:9443"],
                                   ["--bind", "[::1]:9443", "--metrics-bind", "[::]:9443"],
                                   ["--dev", "--metrics-bind", "localhost:8443"],
                                   ["--metrics-bind", "10.0.0.1:8443"]])
def test_the_metrics_port_is_not_the_review_port(flags):
    """--metrics-bind on the port --bind serves (given, or its default) would serve the metrics and the
    reviews on one listener (or fail to bind): refused before anything starts, naming both flags (exit 2)."""
    got = subprocess.run([sys.executable, "-m", "webhook", "serve", *flags], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "GUNICORN_CMD_ARGS"})
    assert got.returncode == 2 and "--metrics-bind" in got.stderr and "--bind" in got.stderr, got.stderr
    assert "a port of their own" in got.stderr


def test_metrics_auth_needs_the_metrics_port():
    """--metrics-auth guards the --metrics-bind port; without one it would guard nothing: refused before
    anything starts, naming both flags."""
    got = subprocess.run([sys.executable, "-m", "webhook", "serve", "--dev", "--metrics-auth"], capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 1 and "--metrics-auth" in got.stderr and "needs --metrics-bind" in got.stderr, got.stderr
