"""serve's TLS hardening (issue 25, docs/hardening.md): the client certificate's subject pinned per connection,
the TLS minimum version and the TLS 1.2 cipher suites, on the real server process."""

import json
import socket
import ssl

import pytest
import requests

from tests.helpers import review, trainjob
from tests.process import webhook_server
from tests.server.test_server import RUNTIME_ARGS, SETTINGS
from webhook import certs


def _client_pair(tmp, ca_key, ca_cert, cn: str) -> tuple[str, str]:
    key, cert = certs.make_leaf(ca_key, ca_cert, [cn], client=True)
    crt, pem = tmp / f"{cn}.crt", tmp / f"{cn}.key"
    crt.write_bytes(certs.pem_cert(cert))
    pem.write_bytes(certs.pem_key(key))
    return str(crt), str(pem)


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    """A server that wants client certificates from one CA, and of those only the subject kube-apiserver."""
    tmp = tmp_path_factory.mktemp("pinned")
    ca_key, ca_cert = certs.make_ca("clients")
    (tmp / "client-ca.crt").write_bytes(certs.pem_cert(ca_cert))
    pairs = {cn: _client_pair(tmp, ca_key, ca_cert, cn) for cn in ("kube-apiserver", "intruder")}
    with webhook_server(tmp, "--settings", SETTINGS, *RUNTIME_ARGS, "--client-ca", str(tmp / "client-ca.crt"),
                        "--client-subject", "kube-apiserver", client_cert=pairs["kube-apiserver"]) as s:
        yield s, pairs


def _mutate(base, ca, cert):
    return requests.post(base + "/mutate", data=json.dumps(review(trainjob())),
                         headers={"Content-Type": "application/json"}, verify=ca, cert=cert, timeout=10)


def test_the_pinned_subject_is_served(pinned):
    (base, ca, _, _), pairs = pinned
    got = _mutate(base, ca, pairs["kube-apiserver"])
    assert got.status_code == 200 and got.json()["response"]["allowed"] is True


def test_another_subject_of_the_same_ca_is_refused_at_the_handshake(pinned):
    (base, ca, log, _), pairs = pinned
    with pytest.raises(requests.exceptions.ConnectionError):
        _mutate(base, ca, pairs["intruder"])
    with pytest.raises(requests.exceptions.ConnectionError):
        _mutate(base, ca, None)  # and no certificate at all, as before
    # The refusal is per connection: the pinned subject is still served after them.
    assert _mutate(base, ca, pairs["kube-apiserver"]).status_code == 200


def _handshake(base, ca, maximum=ssl.TLSVersion.MAXIMUM_SUPPORTED, ciphers=None) -> str:
    port = int(base.rsplit(":", 1)[1])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca)
    ctx.maximum_version = maximum
    if ciphers:
        ctx.set_ciphers(ciphers)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.version()


def test_tls_1_2_offers_only_ecdhe_aead_suites_by_default(tmp_path):
    with webhook_server(tmp_path, "--settings", SETTINGS, *RUNTIME_ARGS) as (base, ca, _, _):
        assert _handshake(base, ca, ssl.TLSVersion.TLSv1_2, "ECDHE+AESGCM") == "TLSv1.2"
        assert _handshake(base, ca) == "TLSv1.3"
        for weak in ("AES128-SHA", "ECDHE-ECDSA-AES128-SHA"):  # no forward secrecy; CBC
            with pytest.raises((ssl.SSLError, ConnectionResetError)):
                _handshake(base, ca, ssl.TLSVersion.TLSv1_2, weak)


def test_tls_minimum_version_1_3_refuses_1_2(tmp_path):
    with webhook_server(tmp_path, "--settings", SETTINGS, *RUNTIME_ARGS,
                        "--tls-min-version", "1.3") as (base, ca, _, _):
        assert _handshake(base, ca) == "TLSv1.3"
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            _handshake(base, ca, ssl.TLSVersion.TLSv1_2)


def test_bad_tls_options_stop_the_server_with_a_message(tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT

    certs.write_dev_pair(tmp_path, ["localhost"])
    base = [sys.executable, "-m", "webhook", "serve", "--settings", SETTINGS, "--cert-dir", str(tmp_path),
            "--bind", "127.0.0.1:0", *RUNTIME_ARGS]
    got = subprocess.run(base + ["--tls-ciphers", "NO-SUCH-CIPHER"], capture_output=True, text=True, timeout=30,
                         cwd=ROOT)
    assert got.returncode != 0 and "'NO-SUCH-CIPHER' matches no cipher suite" in got.stderr, got.stderr
    got = subprocess.run(base + ["--client-subject", "kube-apiserver"], capture_output=True, text=True, timeout=30,
                         cwd=ROOT)
    assert got.returncode != 0 and "no client CA" in got.stderr, got.stderr
