"""The chart installed on the harness's node, as test_install.py and test_two_nodes.py use it: the release's names, a
client of the API server (the load that creates TrainJobs continuously, timed, and its figures), the installed
release's handle, and helpers on sockets, certificates and logs. (Issue 49: 390 lines of these lived inside
test_install.py.)"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import http.client
import json
import re
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.e2e import image as image_mod
from tests.e2e import toolchain
from tests.e2e.cluster import ControlPlane
from tests.e2e.helm import node_values
from tests.e2e.node import Images, NodeCluster
from tests.e2e.node_env import CREDS_PATH, NS, ensure_namespaces, entry, kube, reset_workloads
from tests.helpers import ROOT
from tests.process import eventually

CHART = ROOT / "charts" / "dispatch-admission"
RELEASE = "dispatch-admission"
RNS = "dispatch-system"
FULL = RELEASE  # the release name holds the chart name: the objects are named after the release
SECRET = f"{FULL}-tls"
CA_SECRET = f"{FULL}-ca"
SELECTOR = f"app.kubernetes.io/name=dispatch-admission,app.kubernetes.io/instance={RELEASE}"
CONFIGURATIONS = (("mutatingwebhookconfigurations", FULL), ("validatingwebhookconfigurations", FULL),
                  ("validatingwebhookconfigurations", f"{FULL}-runtimes"))
LOAD_NS = "load"
CREDENTIALS = [{"name": "checkpoint-store", "secret": "s3-credentials", "mountPath": CREDS_PATH}]
SLOW = 1.0  # seconds: a create slower than this is counted as slow
UPGRADE = "helm upgrade (new settings)"
INVALID_EDIT = "settings ConfigMap edited to invalid JSON"


# ---- the API server, spoken to directly (the load client and the pollers) ----

class Api:
    """HTTPS to the API server as the admin, one kept-alive connection per instance (not thread-safe)."""

    def __init__(self, c: ControlPlane, timeout: float = 30, impersonate: str | None = None):
        """`impersonate`: act as this user (the admin's right to impersonate; RBAC then judges the user)."""
        self.c, self.timeout = c, timeout
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if impersonate:
            self.headers["Impersonate-User"] = impersonate
        self.ctx = ssl.create_default_context(cafile=c.ca_file)
        self.ctx.load_cert_chain(c.admin_cert, c.admin_key)
        self.conn: http.client.HTTPSConnection | None = None

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPSConnection(self.c.address, self.c.port, context=self.ctx,
                                                        timeout=self.timeout)
            try:
                headers = dict(self.headers)
                if method == "PATCH":
                    headers["Content-Type"] = "application/merge-patch+json"
                self.conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
                resp = self.conn.getresponse()
                data = resp.read()
                return resp.status, (json.loads(data) if data else {})
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # the API server closed a kept-alive connection; nothing reached it
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def exists(self, path: str) -> bool:
        status, _ = self.request("GET", path)
        assert status in (200, 404), (path, status)
        return status == 200

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def load_trainjob(name: str, phase: str) -> dict:
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": name, "namespace": LOAD_NS, "labels": {"dispatch-e2e/load": phase}},
            "spec": {"runtimeRef": {"name": "torch-distributed"}, "suspend": True}}


@dataclass
class Create:
    started: float     # seconds since the load began
    seconds: float
    status: int        # HTTP status; 0 when the client itself failed
    message: str
    patched: bool      # our entry came back on the created object
    publish: str = ""  # the publish image digest in that entry
    retried: bool = False  # sent again after Trainer's own webhook dropped the API server's connection


# Trainer's webhooks (its controller manager, a process of this harness, not the webhook under test): the API
# server's kept-alive connection to it broke as it wrote (500 "write: broken pipe", once in a cold run of
# 2026-12-05). A client sees a 500 it may retry; the load retries once, counted, and fails on any other answer.
TRAINER_TRANSPORT = re.compile(r'failed calling webhook "[a-z.]*trainer\.kubeflow\.org".*'
                               r"(broken pipe|connection reset by peer|EOF)")


@dataclass
class Load:
    """`workers` threads creating suspended TrainJobs, each at most once every `interval` seconds, up to `limit`
    creates in all; every create is timed and its answer kept."""
    c: ControlPlane
    phase: str
    workers: int = 4
    interval: float = 0.5
    limit: int = 600
    results: list[Create] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._threads: list[threading.Thread] = []
        self.t0 = time.monotonic()

    def _run(self):
        api = Api(self.c, timeout=35)
        path = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{LOAD_NS}/trainjobs"
        try:
            while not self._stop.is_set():
                with self._lock:
                    if self._next >= self.limit:
                        return
                    i, self._next = self._next, self._next + 1
                began = time.monotonic()
                retried = False
                try:
                    status, body = api.request("POST", path, load_trainjob(f"{self.phase}-{i:04d}", self.phase))
                    if status == 500 and TRAINER_TRANSPORT.search(body.get("message", "")):
                        retried = True
                        status, body = api.request("POST", path, load_trainjob(f"{self.phase}-{i:04d}", self.phase))
                    message = "" if status == 201 else body.get("message", json.dumps(body))[:600]
                    patched = status == 201 and entry(body) is not None
                    digest = re.search(r"@(sha256:[0-9a-f]{64})", json.dumps(entry(body))) if patched else None
                except (OSError, http.client.HTTPException) as e:
                    api.close()
                    status, message, patched, digest = 0, f"client: {type(e).__name__}: {e}", False, None
                done = time.monotonic()
                with self._lock:
                    self.results.append(Create(began - self.t0, done - began, status, message, patched,
                                               digest.group(1) if digest else "", retried))
                self._stop.wait(max(0.0, self.interval - (done - began)))
        finally:
            api.close()

    def start(self) -> Load:
        for n in range(self.workers):
            t = threading.Thread(target=self._run, name=f"load-{self.phase}-{n}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def now(self) -> float:
        return time.monotonic() - self.t0

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def in_flight(self) -> int:
        with self._lock:
            return self._next - len(self.results)

    def wait_creates(self, n: int, timeout: float = 300) -> None:
        """Until `n` more creates have been answered (the load keeps going meanwhile)."""
        target = self.count() + n

        def made() -> bool:
            assert any(t.is_alive() for t in self._threads), "the load stopped"
            return self.count() >= target

        eventually(made, f"the load made {target} creates", timeout, every=0.2,
                   detail=lambda: f"{self.count()} of {target}")

    def stop(self) -> list[Create]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return sorted(self.results, key=lambda r: r.started)


def sent_again(send: Callable[[], tuple[int, Any]], transient: tuple[int, ...] = (429, 500, 504),
               timeout: float = 600) -> tuple[int, Any]:
    """`send()`'s (status, body), sent again every 2 s for `timeout` s at most while the API server answers with a
    `transient` status (this 2-core node's times out, 504, or sheds, 429, under load: a tenant retries); the last
    answer when time is up."""
    last: list[tuple[int, Any]] = []

    def answered() -> bool:
        last[:] = [send()]
        return last[0][0] not in transient

    with contextlib.suppress(AssertionError):
        eventually(answered, f"an answer other than {transient}", timeout, every=2)
    return last[0]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


TABLE_HEAD = "| phase | creates | failed | slow (>1 s) | p50 ms | p99 ms | max ms |"


def summarise(phase: str, results: list[Create], began: float = 0.0, **extra) -> dict:
    """The phase's figures, printed as its row of the table (TABLE_HEAD) and in full; `began` (seconds into the
    load) is when its event started, and the times listed (failed_at_s, slow_at_s) are from it. A phase is
    measured only if the load made creates before its event and after it."""
    assert [r for r in results if r.started < began] or not began, f"{phase}: no create before the event"
    assert [r for r in results if r.started >= began], f"{phase}: no create after the event began"
    failed = [r for r in results if r.status != 201]
    seconds = [r.seconds for r in results]
    figures = {"creates": len(results), "failed": len(failed), "slow": sum(s > SLOW for s in seconds),
               "failed_at_s": [round(r.started - began, 1) for r in failed][:20],
               "slow_at_s": [round(r.started - began, 1) for r in results if r.seconds > SLOW][:20],
               "p50_ms": round(percentile(seconds, 0.50) * 1000), "p99_ms": round(percentile(seconds, 0.99) * 1000),
               "max_ms": round(max(seconds) * 1000),
               "unpatched": sum(r.status == 201 and not r.patched for r in results),
               "retried_after_trainers_webhook_dropped": sum(r.retried for r in results),
               "failures": sorted({f"{r.status}: {r.message[:300]}" for r in failed}), **extra}
    row = " | ".join(str(figures[k]) for k in ("creates", "failed", "slow", "p50_ms", "p99_ms", "max_ms"))
    print(f"\n{TABLE_HEAD}\n| {phase} | {row} |\n[{phase}] {json.dumps(figures, indent=1)}")
    return figures


LOAD_COLLECTIONS = (f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{LOAD_NS}/trainjobs",
                    f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{LOAD_NS}/jobsets")


def delete_load(c: ControlPlane, timeout: float = 180) -> None:
    """The load's TrainJobs and what Trainer made of them (suspended JobSets and Jobs: no pod ever ran): one
    DELETE of each collection (the garbage collector takes the dependents), then polled until both are empty.
    `kubectl delete --all --wait` watched each object in turn: 96 s for the ~450 TrainJobs of the hostile test,
    of which the deletes took 5 s."""
    api = Api(c, timeout=120)

    def deleted(path: str) -> bool:
        status, got = api.request("DELETE", path)
        # 504: the request's time ran out first (the API server goes on deleting); sent again until a 200
        assert status in (200, 504), (path, status, str(got)[:300])
        return status == 200

    def empty(path: str) -> bool:
        status, got = api.request("GET", f"{path}?limit=1")
        assert status == 200, (path, status, str(got)[:300])
        return not got["items"]

    try:
        for path in LOAD_COLLECTIONS:
            eventually(lambda path=path: deleted(path), f"DELETE {path} answered 200", timeout, every=1)
        for path in LOAD_COLLECTIONS:
            eventually(lambda path=path: empty(path), f"{path} emptied", timeout, every=0.5)
    finally:
        api.close()


# ---- the module's cluster and release ----

@dataclass
class Installed:
    nc: NodeCluster
    cluster: ControlPlane
    images: Images
    image: str          # the webhook image, HOST/dispatch-admission@sha256:...
    helm: str
    tmp: Path
    values: dict
    installed_in: float = 0.0

    def helm_run(self, *args: str, values: dict | None = None, check: bool = True, timeout: float = 600):
        cmd = [self.helm, *args, "--kubeconfig", self.cluster.kubeconfig]
        if values is not None:
            path = self.tmp / f"values-{time.monotonic_ns()}.yaml"
            path.write_text(yaml.safe_dump(values))
            cmd += ["-f", str(path)]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and got.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({got.returncode}):\n{got.stdout}\n{got.stderr}")
        return got

    def install(self, timeout: str = "8m") -> None:
        """`helm install --wait` with the e2e values; a failed install raises with the pods, the release's events
        and the webhook's logs."""
        c = self.cluster
        started = time.monotonic()
        got = self.helm_run("install", RELEASE, str(CHART), "--namespace", RNS, "--create-namespace", "--wait",
                            "--timeout", timeout, values=self.values, check=False)
        self.installed_in = time.monotonic() - started
        if got.returncode != 0:
            pods = c.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
            events = c.kubectl("get", "events", "-n", RNS, "--sort-by=.lastTimestamp", check=False).stdout
            logs_ = c.kubectl("logs", "-n", RNS, "-l", SELECTOR, "--tail=60", "--prefix", check=False)
            raise AssertionError(f"helm install failed:\n{got.stdout}\n{got.stderr}\n{pods}\n{events[-6000:]}\n"
                                 f"{logs_.stdout[-6000:]}{logs_.stderr[-2000:]}")
        print(f"helm install --wait: {self.installed_in:.0f}s")

    def pods(self) -> list[dict]:
        return kube(self.cluster).pods(RNS, SELECTOR)

    def ready_pods(self) -> list[dict]:
        return [p for p in self.pods() if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]

    def wait_settled(self, replicas: int = 2, timeout: float = 300) -> list[dict]:
        """The Deployment rolled out, `replicas` ready pods and no other (none terminating)."""
        self.cluster.kubectl("rollout", "status", f"deployment/{FULL}", "-n", RNS, f"--timeout={int(timeout)}s",
                             timeout=timeout + 30)

        def settled() -> list[dict] | None:
            ready = self.ready_pods()
            return ready if len(self.pods()) == replicas and len(ready) == replicas else None

        return eventually(settled, f"{replicas} ready webhook pods and no other", timeout, every=0.5,
                          detail=lambda: json.dumps([(p["metadata"]["name"], p.get("status", {}).get("phase"))
                                                     for p in self.pods()]))


def webhook_values(images: Images, image: str) -> dict:
    # the helm test's TrainJobs go where ours are served, on a runtime that exists here
    return node_values(images.publish, image, NS)


def uninstall_leftovers(env: Installed) -> None:
    """After a failed test: no fail-closed webhook left without pods, and no load left for the node's teardown."""
    if env.helm_run("status", RELEASE, "-n", RNS, check=False).returncode == 0:
        env.helm_run("uninstall", RELEASE, "-n", RNS, "--no-hooks", "--wait", "--timeout", "2m", check=False)
    with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
        delete_load(env.cluster)


def ready_for_release(stack: contextlib.ExitStack, nc: NodeCluster) -> str:
    """The shared node made ready for a release: settled, the load's namespace made, every workload gone when
    `stack` closes (its last step: after the release, and its webhooks, are gone). The session's webhook image
    (built once, by test_image.py when it ran first), pushed to this node's registry, is returned."""
    nc.settle()
    ensure_namespaces(nc.cluster, LOAD_NS)
    stack.callback(reset_workloads, nc.cluster, (NS, LOAD_NS))
    started = time.monotonic()
    webhook_image = image_mod.build_webhook_image(nc.registry)
    print(f"\nwebhook image {webhook_image} ready in {time.monotonic() - started:.0f}s")
    return webhook_image


def install_release(stack: contextlib.ExitStack, nc: NodeCluster, tmp: Path, webhook_image: str,
                    timeout: str = "8m") -> Installed:
    """The chart installed (`helm install --wait`) with the e2e values, uninstalled when `stack` closes; a failed
    install raises with the pods, the release's events and the webhook's logs."""
    env = Installed(nc, nc.cluster, nc.images, webhook_image, str(toolchain.helm_bin() / "helm"), tmp,
                    webhook_values(nc.images, webhook_image))
    stack.callback(uninstall_leftovers, env)
    env.install(timeout)
    return env


# ---- helpers: sockets, certificates, logs ----

def sockets_of(pid: int) -> list[tuple[str, str]]:
    """(local, peer) of the established TCP connections of the process `pid`, from `ss`."""
    got = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True)
    found = []
    for line in got.stdout.splitlines():
        if f"pid={pid}," in line:
            parts = line.split()
            found.append((parts[2], parts[3]))
    return found


def hex_address(ip: str, port: int) -> str:
    return socket.inet_aton(ip)[::-1].hex().upper() + f":{port:04X}"


def netns_connections(pid: int) -> list[str]:
    """Remote addresses (hex, as /proc/net/tcp writes them) of the established connections in `pid`'s
    network namespace."""
    remote = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if parts[3] == "01":
            remote.append(parts[2])
    return remote


def container_pid(env: Installed, pod: str, container: str = "webhook") -> int:
    got = env.nc.node.crictl("ps", "--name", f"^{container}$", "--label", f"io.kubernetes.pod.name={pod}", "-q")
    (cid,) = got.stdout.split()
    info = json.loads(env.nc.node.crictl("inspect", cid).stdout)
    return int(info["info"]["pid"])


def served_certificate(host: str, port: int, ca_pem: bytes, server_name: str) -> bytes:
    """The PEM certificate served at host:port, verified against `ca_pem` for `server_name`."""
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    with socket.create_connection((host, port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name) as tls:
            der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


def secret_files(c: ControlPlane, name: str = SECRET) -> dict[str, bytes] | None:
    s = c.get("secret", name, RNS)
    if s is None:
        return None
    return {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}


def pem_certs(data: bytes) -> list[bytes]:
    return [m.group(0).encode() for m in re.finditer(
        r"-----BEGIN CERTIFICATE-----\n.+?\n-----END CERTIFICATE-----\n", data.decode(), re.S)]


def bundles(c: ControlPlane) -> dict[str, list[bytes]]:
    """Every webhook's caBundle in the release's three configurations, as lists of PEM certificates."""
    out = {}
    for kind, name in CONFIGURATIONS:
        for w in c.get(kind.rstrip("s"), name)["webhooks"]:
            out[f"{kind}/{name}/{w['name']}"] = pem_certs(base64.b64decode(w["clientConfig"].get("caBundle", "")))
    return out


def pod_ip(pod: dict) -> str:
    return pod["status"]["podIP"]


def serves(pod: dict, files: dict[str, bytes]) -> bool:
    """Whether the pod serves the pair in `files` (a handshake checked against its CA)."""
    try:
        return served_certificate(pod_ip(pod), 8443, files["ca.crt"], f"{FULL}.{RNS}.svc") == files["tls.crt"]
    except ssl.SSLError:
        return False


def logged_at(line: str) -> float:
    """The time of a `kubectl logs --timestamps` line (RFC 3339 with nanoseconds, UTC)."""
    stamp = line.split(" ", 1)[0]
    return dt.datetime.fromisoformat(stamp[:26].rstrip("Z") + "+00:00").timestamp()


def review_lines(text: str) -> list[dict]:
    found = []
    for line in text.splitlines():
        start = line.find("{")
        if start >= 0 and '"msg": "review"' in line:
            try:
                found.append(json.loads(line[start:]))
            except ValueError:
                pass
    return found
