"""Faults on the end-to-end cluster: the API server down, the webhook down, client authentication."""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path

import pytest
import requests
import yaml

from tests.helpers import EXAMPLES, MANAGER, eventually, review, trainjob

NS = "team-a"


def direct(hook, job, endpoint="mutate", cert=None):
    r = requests.post(hook.url + "/" + endpoint, json=review(job), verify=hook.ca, timeout=15, cert=cert)
    assert r.status_code == 200
    return r.json()["response"]


def registration(name: str, url: str, ca: str, label: str, mutating_policy="Ignore", validating_policy="Fail"):
    bundle = base64.b64encode(Path(ca).read_bytes()).decode()

    def hook(kind, path, policy):
        return {"name": f"{kind}.{name}.dispatch.go.phpboyscout.uk", "admissionReviewVersions": ["v1"],
                "sideEffects": "None", "timeoutSeconds": 5, "failurePolicy": policy,
                "rules": [{"apiGroups": ["trainer.kubeflow.org"], "apiVersions": ["v1alpha1"],
                           "resources": ["trainjobs"],
                           "operations": ["CREATE", "UPDATE"]}],
                "objectSelector": {"matchLabels": {label: "true"}},
                "clientConfig": {"url": url + path, "caBundle": bundle}}

    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
         "metadata": {"name": name}, "webhooks": [hook("mutate", "/mutate", mutating_policy)]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
         "metadata": {"name": name}, "webhooks": [hook("validate", "/validate", validating_policy)]},
    ]


@contextlib.contextmanager
def registered(cluster, docs):
    for d in docs:
        cluster.apply(d)
    try:
        yield
    finally:
        for d in docs:
            cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found")


def labelled(job, label):
    job["metadata"]["labels"] = {label: "true"}
    return job


def test_apiserver_down_known_runtimes_answered_from_cache(env):
    c, hook = env.cluster, env.route1
    assert direct(hook, trainjob(name="warm-up", namespace=NS))["allowed"]
    c.apiserver_proc.kill()  # an abrupt outage, as a crashed or partitioned API server
    c.apiserver_proc.wait(30)
    try:
        known = direct(hook, trainjob(name="during-outage", namespace=NS))
        assert known["allowed"] and "patch" in known, "a known runtime must be answered from the cache"
        unknown = direct(hook, trainjob(name="unknown-rt", namespace=NS, runtime_name="never-seen"))
        assert unknown["allowed"] is False
        assert unknown["status"]["code"] == 503 and unknown["status"]["message"].startswith("ErrUnavailable: ")
    finally:
        c.start_apiserver(c._apiserver_extra)
    runtime = yaml.safe_load((EXAMPLES / "runtimes" / "torch-distributed.yaml").read_text())
    runtime["metadata"] = {"name": "after-outage"}
    c.apply(runtime)
    # The cache catches up: the new runtime arrives through the re-established watch.
    def answered_from_the_cache() -> bool:
        gets = hook.metric("dispatch_admission_api_requests_total", verb="get")
        resp = direct(hook, trainjob(name="after", namespace=NS, runtime_name="after-outage"))
        return resp["allowed"] and hook.metric("dispatch_admission_api_requests_total", verb="get") == gets

    eventually(answered_from_the_cache, "the cache did not catch up after the API server returned", 60, 1)


def test_webhook_stopped_nothing_is_admitted_unchecked(env, serve):
    c = env.cluster
    label = "dispatch-e2e/down"
    hook = serve(kubeconfig=c.kubeconfig)
    with registered(c, registration("dispatch-admission-down", hook.url, hook.ca, label)):
        c.apply(labelled(trainjob(name="while-up", namespace=NS), label))
        hook.process.terminate()
        hook.process.wait(30)
        got = c.apply(labelled(trainjob(name="while-down", namespace=NS), label), check=False)
        assert got.returncode != 0 and "failed calling webhook" in got.stderr, got.stderr
        assert c.get("trainjob", "while-down", NS) is None


def test_client_certificate_required_and_verified(env, serve, tmp_path):
    c = env.cluster
    label = "dispatch-e2e/mtls"
    hook = serve("--client-ca", c.ca_file, kubeconfig=c.kubeconfig, client_cert=c.webhook_client_cert)
    url, ca = hook.url, hook.ca
    # Refused at the handshake. Under TLS 1.3 the client's certificate is checked after the client has
    # seen the handshake complete, and asyncio closes a failed handshake without flushing the alert, so
    # the client sees either the alert (SSLError) or the connection closed (ConnectionError, its base).
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(url + "/healthz", verify=ca, timeout=5)
    other_ca_cert = tmp_path / "stranger"
    from webhook import certs
    certs.write_dev_pair(other_ca_cert, ["stranger"])
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(url + "/healthz", verify=ca, timeout=5,
                     cert=(str(other_ca_cert / "tls.crt"), str(other_ca_cert / "tls.key")))
    assert requests.get(url + "/healthz", verify=ca, timeout=5, cert=c.webhook_client_cert).status_code == 200
    with registered(c, registration("dispatch-admission-mtls", url, ca, label)):
        c.apply(labelled(trainjob(name="mtls-job", namespace=NS), label))
    eventually(lambda: hook.logged('"mtls-job"'),
               "the API server did not reach the webhook with its client certificate")
    stored = c.get("trainjob", "mtls-job", NS)
    assert any(e["manager"] == MANAGER for e in stored["spec"]["runtimePatches"])
