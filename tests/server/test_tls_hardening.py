"""serve's TLS hardening (issue 25, docs/hardening.md): the client certificate's subject pinned per connection,
the TLS minimum version and the TLS 1.2 cipher suites, on the real server process."""

import json
import ssl
import subprocess
import sys

import pytest
import requests

from tests.helpers import ROOT, review, trainjob
from tests.process import RUNTIME_ARGS, SETTINGS
from tests.tls import handshake
from webhook import certs


def _client_pair(tmp, ca_key, ca_cert, cn: str) -> tuple[str, str]:
    key, cert = certs.make_leaf(ca_key, ca_cert, [cn], client=True)
    crt, pem = tmp / f"{cn}.crt", tmp / f"{cn}.key"
    crt.write_bytes(certs.pem_cert(cert))
    pem.write_bytes(certs.pem_key(key))
    return str(crt), str(pem)


@pytest.fixture(scope="module")
def pinned(serve_module, tmp_path_factory):
    """A server that wants client certificates from one CA, and of those only the subject kube-apiserver."""
    tmp = tmp_path_factory.mktemp("pinned")
    ca_key, ca_cert = certs.make_ca("clients")
    (tmp / "client-ca.crt").write_bytes(certs.pem_cert(ca_cert))
    pairs = {cn: _client_pair(tmp, ca_key, ca_cert, cn) for cn in ("kube-apiserver", "intruder")}
    hook = serve_module("--client-ca", str(tmp / "client-ca.crt"), "--client-subject", "kube-apiserver",
                        client_cert=pairs["kube-apiserver"])
    return hook, pairs


def _mutate(base, ca, cert):
    return requests.post(base + "/mutate", data=json.dumps(review(trainjob())),
                         headers={"Content-Type": "application/json"}, verify=ca, cert=cert, timeout=10)


def test_the_pinned_subject_is_served(pinned):
    hook, pairs = pinned
    base, ca = hook.url, hook.ca
    got = _mutate(base, ca, pairs["kube-apiserver"])
    assert got.status_code == 200 and got.json()["response"]["allowed"] is True


def test_another_subject_of_the_same_ca_is_refused_at_the_handshake(pinned):
    hook, pairs = pinned
    base, ca = hook.url, hook.ca
    with pytest.raises(requests.exceptions.ConnectionError):
        _mutate(base, ca, pairs["intruder"])
    with pytest.raises(requests.exceptions.ConnectionError):
        _mutate(base, ca, None)  # and no certificate at all, as before
    # The refusal is per connection: the pinned subject is still served after them.
    assert _mutate(base, ca, pairs["kube-apiserver"]).status_code == 200


def test_tls_1_2_offers_only_ecdhe_aead_suites_by_default(serve):
    hook = serve()
    assert handshake(hook.url, hook.ca, ssl.TLSVersion.TLSv1_2, "ECDHE+AESGCM") == "TLSv1.2"
    assert handshake(hook.url, hook.ca) == "TLSv1.3"
    for weak in ("AES128-SHA", "ECDHE-ECDSA-AES128-SHA"):  # no forward secrecy; CBC
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            handshake(hook.url, hook.ca, ssl.TLSVersion.TLSv1_2, weak)


def test_tls_minimum_version_1_3_refuses_1_2(serve):
    hook = serve("--tls-min-version", "1.3")
    assert handshake(hook.url, hook.ca) == "TLSv1.3"
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        handshake(hook.url, hook.ca, ssl.TLSVersion.TLSv1_2)


def test_bad_tls_options_stop_the_server_with_a_message(tmp_path):
    certs.write_dev_pair(tmp_path, ["localhost"])
    base = [sys.executable, "-m", "webhook", "serve", "--settings", str(SETTINGS), "--cert-dir", str(tmp_path),
            "--bind", "127.0.0.1:0", *RUNTIME_ARGS]
    got = subprocess.run(base + ["--tls-ciphers", "NO-SUCH-CIPHER"], capture_output=True, text=True, timeout=30,
                         cwd=ROOT)
    assert got.returncode != 0 and "'NO-SUCH-CIPHER' matches no cipher suite" in got.stderr, got.stderr
    got = subprocess.run(base + ["--client-subject", "kube-apiserver"], capture_output=True, text=True, timeout=30,
                         cwd=ROOT)
    assert got.returncode != 0 and "no client CA" in got.stderr, got.stderr
