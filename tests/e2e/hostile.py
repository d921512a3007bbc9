"""A hostile tenant (issue 33): what one tenant with the right to create TrainingRuntimes and TrainJobs in its own
namespace can send, built here for the node test (tests/e2e/test_install.py) and the API-level tests.

- runtimes near the API server's object size limit, of the three shapes that grow a runtime cache: thousands of
  env entries, thousands of long names, tens of thousands of replicated jobs;
- a flood of AdmissionReviews naming random runtimes, sent straight to the webhook's Service from a pod (the
  script below runs in the webhook's own image: Python's standard library only);
- a flood of random bearer tokens at the metrics port (`metrics.auth`).
"""

from __future__ import annotations

import json

OBJECT_BYTES = 1_400_000  # near etcd's request limit (1.5 MiB), under which the API server stores an object
SHAPES = ("env", "names", "jobs")
JOBS_BYTES = 500_000  # 5,000 jobs, 50 times the cap: what this node's API server defaults within its timeout


def _runtime(name: str, namespace: str, jobs: list[dict], pod_extra: dict | None = None) -> dict:
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {"replicatedJobs": jobs}}}}


def _job(name: str, pod: dict) -> dict:
    return {"name": name, "replicas": 1, "template": {"spec": {"template": {"spec": pod}}}}


def large_runtime(shape: str, name: str, namespace: str, size: int = OBJECT_BYTES) -> dict:
    """A TrainingRuntime of about `size` bytes of JSON, grown one of three ways (SHAPES)."""
    if shape == "env":  # what the rules never read: the keeper must still parse it
        per = len(json.dumps({"name": "VARIABLE_000000", "value": "v" * 80})) + 1
        env = [{"name": f"VARIABLE_{i:06d}", "value": "v" * 80} for i in range(size // per)]
        return _runtime(name, namespace,
                        [_job("node", {"containers": [{"name": "node", "image": "pytorch", "env": env}]})])
    if shape == "names":  # what a runtime cache keeps: 1,990 volume names (under the name count), each long
        width = 640
        volume = {"name": "v00000-" + "n" * (width - 7), "emptyDir": {}}
        count = min(1990, size // (len(json.dumps(volume)) + 1))
        volumes = [{"name": f"v{i:05d}-" + "n" * (width - 7), "emptyDir": {}} for i in range(count)]
        return _runtime(name, namespace, [_job("node", {"containers": [{"name": "node", "image": "pytorch"}],
                                                        "volumes": volumes})])
    if shape == "jobs":  # what a cache walks per job: thousands of container-less replicated jobs (the API server
        # defaults each, so 1 MB sent is stored as several and takes seconds: JOBS_BYTES bounds it)
        size = min(size, JOBS_BYTES)
        per = len(json.dumps(_job("j000000", {"containers": []}))) + 1
        jobs = [_job(f"j{i:06d}", {"containers": []}) for i in range(size // per)]
        jobs[0]["template"]["spec"]["template"]["spec"]["containers"] = [{"name": "node", "image": "pytorch"}]
        return _runtime(name, namespace, jobs)
    raise ValueError(shape)


def tenant_rbac(namespace: str, user: str) -> list[dict]:
    """What platform teams routinely hand a tenant: create and update TrainingRuntimes and TrainJobs in its
    namespace (and read them), nothing else."""
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "trainer-tenant", "namespace": namespace},
         "rules": [{"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainingruntimes", "trainjobs"],
                    "verbs": ["get", "list", "watch", "create", "update", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "trainer-tenant", "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "trainer-tenant"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]},
    ]


# The flood, run in a pod: REVIEWS threads post AdmissionReviews naming random runtimes to the webhook's Service
# (TLS unverified: the attacker cares for no certificate), TOKENS threads ask /metrics with random bearer tokens,
# for SECONDS; it prints one JSON line of counts at the end. Standard library only (the webhook's distroless image).
FLOOD = r'''
import http.client, json, os, random, ssl, string, threading, time
target, metrics, seconds = os.environ["TARGET"], os.environ.get("METRICS", ""), float(os.environ["SECONDS"])
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
counts, lock, end = {}, threading.Lock(), time.monotonic() + seconds
def note(key):
    with lock: counts[key] = counts.get(key, 0) + 1
def name(): return "r-" + "".join(random.choices(string.ascii_lowercase + string.digits, k=20))
def review():
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": name(), "operation": "CREATE", "namespace": "tenant-a", "name": "x",
        "kind": {"group": "trainer.kubeflow.org", "version": "v1alpha1", "kind": "TrainJob"},
        "resource": {"group": "trainer.kubeflow.org", "version": "v1alpha1", "resource": "trainjobs"},
        "object": {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                   "metadata": {"name": "x", "namespace": "tenant-a"},
                   "spec": {"runtimeRef": {"name": name(), "kind": random.choice(["TrainingRuntime",
                                                                                  "ClusterTrainingRuntime"])}}}}}
    return json.dumps(body).encode()
def reviews():
    conn = None
    while time.monotonic() < end:
        try:
            if conn is None:
                host, port = target.rsplit(":", 1)
                conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=10)
            conn.request("POST", "/mutate", body=review(), headers={"Content-Type": "application/json"})
            got = conn.getresponse(); data = json.loads(got.read())
            status = data.get("response", {}).get("status", {}).get("code", 200)
            note(f"review {got.status} {status}")
        except Exception as e:
            note(f"review error {type(e).__name__}"); conn = None; time.sleep(0.05)
def tokens():
    conn = None
    while time.monotonic() < end:
        try:
            if conn is None:
                host, port = metrics.rsplit(":", 1)
                conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=15)
            conn.request("GET", "/metrics", headers={"Authorization": "Bearer " + name() * 8})
            got = conn.getresponse(); got.read(); note(f"metrics {got.status}")
        except Exception as e:
            note(f"metrics error {type(e).__name__}"); conn = None; time.sleep(0.05)
threads = [threading.Thread(target=reviews) for _ in range(int(os.environ.get("REVIEWS", "4")))]
threads += [threading.Thread(target=tokens) for _ in range(int(os.environ.get("TOKENS", "2")) if metrics else 0)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(counts), flush=True)
'''


def flood_pod(namespace: str, image: str, target: str, metrics: str, seconds: int, reviews: int = 4,
              tokens: int = 2) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "flood", "namespace": namespace},
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{"name": "flood", "image": image, "command": ["python3", "-c", FLOOD],
                                     "env": [{"name": "TARGET", "value": target}, {"name": "METRICS", "value": metrics},
                                             {"name": "SECONDS", "value": str(seconds)},
                                             {"name": "REVIEWS", "value": str(reviews)},
                                             {"name": "TOKENS", "value": str(tokens)}],
                                     "securityContext": {"allowPrivilegeEscalation": False,
                                                         "readOnlyRootFilesystem": True,
                                                         "capabilities": {"drop": ["ALL"]}},
                                     "resources": {"limits": {"memory": "128Mi"}}}]}}


# Issue 47's tenant at volume: a runtime whose every answer is large (a patch per target job), a client that
# pipelines reviews naming it and never reads an answer, and bodies whose parsed form is far larger than their bytes.

def wide_runtime(name: str, namespace: str, jobs: int = 100) -> dict:
    """A TrainingRuntime of `jobs` replicated jobs, each with a `node` container: the webhook's entry patches every
    one, so each /mutate answer naming it is some 78 KB for a request of a few hundred bytes."""
    return _runtime(name, namespace, [_job(f"node-{i:03d}", {"containers": [{"name": "node", "image": "pytorch"}]})
                                      for i in range(jobs)])


# Run in a pod: CONNECTIONS TLS connections each send COUNT pipelined /mutate reviews naming RUNTIME and never
# read a byte back (a small receive buffer, so the answers back up into the server at once); each holds on for
# SECONDS or until the server gives up on it. One JSON line at the end: reviews sent per connection and how each
# connection ended ("held": still open at the end; else the error that ended the sending).
PIPELINE = r'''
import json, os, socket, ssl, threading, time
host, port = os.environ["TARGET"].rsplit(":", 1)
count, seconds, runtime = int(os.environ["COUNT"]), float(os.environ["SECONDS"]), os.environ["RUNTIME"]
namespace = os.environ["NAMESPACE"]
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
results, lock = [], threading.Lock()
def request(i):
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": f"pipe-{i}", "operation": "CREATE", "namespace": namespace, "name": "x",
        "kind": {"group": "trainer.kubeflow.org", "version": "v1alpha1", "kind": "TrainJob"},
        "resource": {"group": "trainer.kubeflow.org", "version": "v1alpha1", "resource": "trainjobs"},
        "object": {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                   "metadata": {"name": "x", "namespace": namespace},
                   "spec": {"runtimeRef": {"name": runtime, "kind": "TrainingRuntime"}}}}}).encode()
    head = f"POST /mutate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
def one():
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.settimeout(seconds)
    sent, end, outcome = 0, time.monotonic() + seconds, "held"
    try:
        raw.connect((host, int(port)))
        sock = ctx.wrap_socket(raw, server_hostname=host)
        for i in range(count):
            if time.monotonic() > end:
                break
            sock.sendall(request(i)); sent += 1
        while time.monotonic() < end:  # hold on, reading nothing; a closed connection fails the next send
            time.sleep(1)
            sock.sendall(b"\r\n")
    except (OSError, ssl.SSLError) as e:
        outcome = type(e).__name__
    with lock:
        results.append({"sent": sent, "ended": outcome})
threads = [threading.Thread(target=one) for _ in range(int(os.environ.get("CONNECTIONS", "8")))]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(results), flush=True)
'''

# Run in a pod: THREADS threads post, for SECONDS, bodies of BYTES whose parsed form is large: a flat list of empty
# lists (`[[],[],...]`: one Python list per 3 bytes) and, in turn, a deep one (`[[[...]]]`). One JSON line of
# counts by HTTP status at the end.
NESTED = r'''
import http.client, json, os, ssl, threading, time
host, port = os.environ["TARGET"].rsplit(":", 1)
size, seconds = int(os.environ["BYTES"]), float(os.environ["SECONDS"])
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
flat = b"[" + b"[]," * ((size - 4) // 3) + b"[]]"
deep = b"[" * (size // 2) + b"]" * (size // 2)
counts, lock, end = {}, threading.Lock(), time.monotonic() + seconds
def note(key):
    with lock: counts[key] = counts.get(key, 0) + 1
def post():
    n = 0
    while time.monotonic() < end:
        body, shape = (flat, "flat") if n % 2 == 0 else (deep, "deep")
        n += 1
        try:
            conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=30)
            conn.request("POST", "/validate", body=body, headers={"Content-Type": "application/json"})
            got = conn.getresponse(); got.read(); note(f"{shape} {got.status}"); conn.close()
        except Exception as e:
            note(f"{shape} error {type(e).__name__}"); time.sleep(0.2)
threads = [threading.Thread(target=post) for _ in range(int(os.environ.get("THREADS", "2")))]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(counts), flush=True)
'''


def script_pod(name: str, namespace: str, image: str, script: str, env: dict[str, str],
               memory: str = "256Mi") -> dict:
    """A pod of the webhook's own image (Python's standard library) that runs `script` with `env`, as the tenant
    could: no service account token, no privilege."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{"name": name, "image": image, "command": ["python3", "-c", script],
                                     "env": [{"name": k, "value": v} for k, v in env.items()],
                                     "securityContext": {"allowPrivilegeEscalation": False,
                                                         "readOnlyRootFilesystem": True,
                                                         "capabilities": {"drop": ["ALL"]}},
                                     "resources": {"limits": {"memory": memory}}}]}}


def runtime_at_cap(name: str, namespace: str) -> dict:
    """A TrainingRuntime whose kept facts come to the per-runtime cap (webhook.core.runtimes.MAX_STORED_BYTES, in
    UTF-8 bytes) less a little: one `node` job and as many volumes of 63-character names as fit (some 95 KB of
    JSON each)."""
    from webhook.core.runtimes import MAX_STORED_BYTES

    count = (MAX_STORED_BYTES - 512) // 63
    volumes = [{"name": f"v{i:04d}-" + "x" * 57, "emptyDir": {}} for i in range(count)]
    return _runtime(name, namespace, [_job("node", {"containers": [{"name": "node", "image": "pytorch"}],
                                                    "volumes": volumes})])
