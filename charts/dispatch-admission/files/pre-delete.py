"""`helm uninstall`'s pre-delete hook: delete this release's webhook configurations before anything else.

Helm 3 deletes by kind in a fixed order in which webhook configurations are unknown kinds, so last: the
Service and Deployment would go first, and the fail-closed validating webhook would refuse every TrainJob
until the configurations follow (or for good, if the uninstall stops half way). Helm runs pre-delete hooks
before deleting any resource, so deleting the configurations here closes that window.
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
CFG = json.loads(os.environ["DISPATCH_PRE_DELETE_CONFIG"])
HOST = os.environ["KUBERNETES_SERVICE_HOST"]
PORT = os.environ["KUBERNETES_SERVICE_PORT"]
BASE = f"https://[{HOST}]:{PORT}" if ":" in HOST else f"https://{HOST}:{PORT}"
CTX = ssl.create_default_context(cafile=os.path.join(SA, "ca.crt"))


def call(method, path):
    with open(os.path.join(SA, "token")) as f:
        token = f.read().strip()
    req = urllib.request.Request(BASE + path, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, context=CTX, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def main():
    # The fail-closed validating configuration first, then the runtime warnings, then the mutating one.
    for kind, name in CFG["configurations"]:
        path = f"/apis/admissionregistration.k8s.io/v1/{kind}/{name}"
        for attempt in range(5):
            code = call("DELETE", path)
            if code in (200, 202, 404):
                break
            print(f"delete {kind}/{name}: HTTP {code}, retrying", flush=True)
            time.sleep(2 ** attempt)
        else:
            print(f"FAILED: could not delete {kind}/{name} (HTTP {code})", flush=True)
            return 1
        gone = call("GET", path)
        if gone != 404:
            print(f"FAILED: {kind}/{name} is still there after its delete (HTTP {gone})", flush=True)
            return 1
        print(f"deleted {kind}/{name}" if code != 404 else f"{kind}/{name} was already gone", flush=True)
    # Each API server drops a deleted configuration from its webhook cache within moments (an informer):
    # leave it that long before Helm deletes the Service and the pods.
    time.sleep(CFG["settleSeconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
