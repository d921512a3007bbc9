"""`helm test`: prove the webhook answers, through the API server, as cert-manager's startupapicheck does.

Two server-side dry-run creates of a TrainJob (nothing is stored), with the test's ServiceAccount:
- a good TrainJob on the configured runtime must be admitted and, when the settings mount anything,
  come back with the webhook's runtimePatches entry (the mutating webhook answered);
- a TrainJob that breaks rule S3 (a DISPATCH_ env name) must be refused by our webhook under enforce,
  or admitted with a "would deny" warning under warn (the fail-closed validating webhook answered).
Retried until the deadline: right after an install the first replica may still be syncing its cache.
Standard library only: it runs in the webhook's own image.
"""

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request

SA = os.environ.get("SERVICEACCOUNT_DIR", "/var/run/secrets/kubernetes.io/serviceaccount")
CFG = json.loads(os.environ["DISPATCH_TEST_CONFIG"])
HOST = os.environ["KUBERNETES_SERVICE_HOST"]
PORT = os.environ["KUBERNETES_SERVICE_PORT"]
BASE = f"https://[{HOST}]:{PORT}" if ":" in HOST else f"https://{HOST}:{PORT}"
CTX = ssl.create_default_context(cafile=os.path.join(SA, "ca.crt"))
OURS = [f'admission webhook "{name}" denied the request' for name in CFG["webhooks"]]


def dry_run_create(job):
    with open(os.path.join(SA, "token")) as f:
        token = f.read().strip()
    url = (f"{BASE}/apis/trainer.kubeflow.org/v1alpha1/namespaces/{CFG['namespace']}/trainjobs"
           "?dryRun=All&fieldManager=dispatch-admission-helm-test")
    req = urllib.request.Request(url, data=json.dumps(job).encode(), method="POST", headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, context=CTX, timeout=30) as resp:
            return resp.status, json.load(resp), resp.headers.get_all("Warning") or []
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = {"message": body.decode(errors="replace")}
        return e.code, parsed, e.headers.get_all("Warning") or []


def trainjob(prefix, env=None):
    spec = {"runtimeRef": dict(CFG["runtimeRef"], apiGroup="trainer.kubeflow.org")}
    if env:
        spec["trainer"] = {"env": env}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"generateName": prefix, "labels": CFG["labels"]}, "spec": spec}


def check_mutated():
    code, body, _ = dry_run_create(trainjob("dispatch-admission-test-"))
    if code != 201:
        return f"the good TrainJob was not admitted: HTTP {code}: {body.get('message', body)}"
    if CFG["expectEntry"]:
        managers = [p.get("manager") for p in body.get("spec", {}).get("runtimePatches") or []]
        if CFG["manager"] not in managers:
            return f"the good TrainJob came back without the {CFG['manager']} entry (runtimePatches managers: {managers})"
    return None


def check_refused():
    env = [{"name": "DISPATCH_HELM_TEST", "value": "1"}]
    code, body, warnings = dry_run_create(trainjob("dispatch-admission-test-s3-", env))
    if CFG["enforcement"] == "warn":
        if code == 201 and any("would deny" in w for w in warnings):
            return None
        return f"warn mode: expected admission with a 'would deny' warning, got HTTP {code}, warnings {warnings}"
    message = body.get("message", "")
    if code >= 400 and any(m in message for m in OURS) and "ErrInvalid" in message:
        return None
    return f"enforce mode: expected our webhook to refuse rule S3 (ErrInvalid), got HTTP {code}: {message[:500]}"


def main():
    if CFG["namespaceExcluded"]:
        print(f"FAILED: tests.namespace {CFG['namespace']!r} is one the webhook never sees (kube-system, the release "
              "namespace and webhook.excludeNamespaces are excluded): set tests.namespace to one it serves", flush=True)
        return 1
    deadline = time.monotonic() + CFG["timeoutSeconds"]
    delay = 1.0
    while True:
        problems = [p for p in (check_mutated(), check_refused()) if p]
        if not problems:
            entry = f"with the {CFG['manager']} entry" if CFG["expectEntry"] else "(the settings mount nothing)"
            print(f"ok: a TrainJob was admitted {entry}, and one breaking rule S3 was "
                  f"{'warned about' if CFG['enforcement'] == 'warn' else 'refused'} by the webhook")
            return 0
        for p in problems:
            print(p, flush=True)
        if time.monotonic() + delay > deadline:
            print("FAILED: the webhook did not answer as expected before the deadline", flush=True)
            return 1
        time.sleep(delay)
        delay = min(delay * 2, 10.0)


if __name__ == "__main__":
    sys.exit(main())
