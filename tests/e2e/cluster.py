"""A real control plane on loopback: etcd and kube-apiserver built from Go modules, driven by kubectl.

There is no kubelet and no controller manager: objects are stored and admitted, never run. Webhooks
are reached by URL on loopback, as controller-runtime's envtest does.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.e2e import toolchain
from tests.process import free_port, started_ready, stop
from webhook import certs

# Every server process's log, by name: the failure report (conftest.py) appends what each wrote during a failed test.
LOGS: dict[str, Path] = {}


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


# Where `ControlPlane.get` reads a kind: (API path, plural, namespaced), by the lower-case singular kubectl takes.
_TRAINER = "/apis/trainer.kubeflow.org/v1alpha1"
_RBAC = "/apis/rbac.authorization.k8s.io/v1"
_ADMISSION = "/apis/admissionregistration.k8s.io/v1"
RESOURCES: dict[str, tuple[str, str, bool]] = {
    **{k: ("/api/v1", f"{k}s", True) for k in ("pod", "service", "serviceaccount", "configmap", "secret",
                                               "resourcequota", "event")},
    "namespace": ("/api/v1", "namespaces", False), "node": ("/api/v1", "nodes", False),
    "deployment": ("/apis/apps/v1", "deployments", True), "job": ("/apis/batch/v1", "jobs", True),
    "cronjob": ("/apis/batch/v1", "cronjobs", True),
    "poddisruptionbudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
    "networkpolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "role": (_RBAC, "roles", True), "rolebinding": (_RBAC, "rolebindings", True),
    "clusterrole": (_RBAC, "clusterroles", False), "clusterrolebinding": (_RBAC, "clusterrolebindings", False),
    **{k: (_ADMISSION, f"{k}s", False) for k in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration",
                                                 "validatingadmissionpolicybinding", "mutatingadmissionpolicybinding")},
    **{k: (_ADMISSION, f"{k[:-1]}ies", False) for k in ("validatingadmissionpolicy", "mutatingadmissionpolicy")},
    "customresourcedefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "trainjob": (_TRAINER, "trainjobs", True), "trainingruntime": (_TRAINER, "trainingruntimes", True),
    "clustertrainingruntime": (_TRAINER, "clustertrainingruntimes", False),
    "jobset": ("/apis/jobset.x-k8s.io/v1alpha2", "jobsets", True),
    "workload": ("/apis/kueue.x-k8s.io/v1beta2", "workloads", True),
}
_SHORT = {"crd": "customresourcedefinition", "netpol": "networkpolicy", "pdb": "poddisruptionbudget"}


def resource(kind: str) -> tuple[str, str, bool]:
    """`kind` ("Pod", "pods", "crd") as (API path, plural, namespaced)."""
    k = _SHORT.get(kind.lower(), kind.lower())
    for name in (k, k.removesuffix("s"), k.removesuffix("es"), k.removesuffix("ies") + "y"):
        if name in RESOURCES:
            return RESOURCES[name]
    raise KeyError(f"ControlPlane.get: no API path for kind {kind!r} (tests/e2e/cluster.py RESOURCES)")


class ControlPlane:
    def __init__(self, workdir: Path, address: str = "127.0.0.1", service_cidr: str = "10.0.0.0/24",
                 extra_args: list[str] | None = None):
        # address: where kube-apiserver listens and what it advertises (the node suite uses an address on
        # its pod bridge, which pods can reach); service_cidr: the Service ClusterIP range.
        import ipaddress

        self.dir = workdir
        self.address = address
        self.service_cidr = service_cidr
        self.service_ip = str(next(ipaddress.ip_network(service_cidr).hosts()))
        self.extra_args = list(extra_args or [])
        self.go_env: dict[str, str] = {}  # GOGC and the like for etcd and kube-apiserver; stock unless set
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bins = toolchain.kubernetes_bins()
        self.kubectl_bin = str(self.bins["kubectl"])
        self.etcd_proc = None
        self.apiserver_proc = None
        self.etcd_log = self.dir / "etcd.log"
        self.apiserver_log = self.dir / "kube-apiserver.log"
        self._pki()
        self.etcd_port, self.etcd_peer_port, self.port = free_port(), free_port(), free_port()
        self.server = f"https://{self.address}:{self.port}"
        self.kubeconfig = str(self.dir / "kubeconfig")
        self._kubeconfig()
        self.admission_config = self._webhook_client_identity()

    # ---- certificates and identities ----

    def _pki(self) -> None:
        pki = self.dir / "pki"
        pki.mkdir(exist_ok=True)
        ca_key, ca_cert = certs.make_ca("e2e kubernetes CA")
        self.ca_file = _write(pki / "ca.crt", certs.pem_cert(ca_cert))
        key, cert = certs.make_leaf(ca_key, ca_cert, ["kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                                     "localhost", "127.0.0.1", self.service_ip,
                                                     *([self.address] if self.address != "127.0.0.1" else [])])
        self.tls_cert = _write(pki / "apiserver.crt", certs.pem_cert(cert))
        self.tls_key = _write(pki / "apiserver.key", certs.pem_key(key))
        # The admin identity: a client certificate in system:masters.
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        admin_key, admin_cert = certs.make_leaf(ca_key, ca_cert, ["admin"], client=True)
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                             x509.NameAttribute(NameOID.COMMON_NAME, "admin")])
        admin_cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
                      .public_key(admin_cert.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(admin_cert.not_valid_before_utc).not_valid_after(admin_cert.not_valid_after_utc)
                      .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                      .sign(ca_key, certs.hashes.SHA256()))
        self.admin_cert = _write(pki / "admin.crt", certs.pem_cert(admin_cert))
        self.admin_key = _write(pki / "admin.key", certs.pem_key(admin_key))
        sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.sa_key = _write(pki / "sa.key", certs.pem_key(sa))
        self.sa_pub = _write(pki / "sa.pub", sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        self._ca = (ca_key, ca_cert)

    def client_cert(self, common_name: str, organisation: str | None = None) -> tuple[str, str]:
        """A client certificate signed by the cluster CA (for the webhook's client-auth test)."""
        ca_key, ca_cert = self._ca
        key, cert = certs.make_leaf(ca_key, ca_cert, [common_name], client=True)
        base = self.dir / "pki" / common_name
        return (_write(base.with_suffix(".crt"), certs.pem_cert(cert)),
                _write(base.with_suffix(".key"), certs.pem_key(key)))

    def _webhook_client_identity(self) -> str:
        """The API server presents a client certificate to every webhook (kube-apiserver's
        --admission-control-config-file mechanism), so a webhook can require one."""
        cert, key = self.client_cert("kube-apiserver-webhook-client")
        self.webhook_client_cert = (cert, key)
        kubeconfig = self.dir / "webhook-client.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "users": [
            {"name": "*", "user": {"client-certificate": cert, "client-key": key}}]}))
        plugin = {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "WebhookAdmissionConfiguration",
                  "kubeConfigFile": str(kubeconfig)}
        config = self.dir / "admission-config.yaml"
        config.write_text(yaml.safe_dump({"apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration",
                                          "plugins": [{"name": n, "configuration": plugin} for n in
                                                      ("ValidatingAdmissionWebhook", "MutatingAdmissionWebhook")]}))
        return str(config)

    def _kubeconfig(self) -> None:
        def b64(path):
            return base64.b64encode(Path(path).read_bytes()).decode()

        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
            "clusters": [{"name": "e2e",
                          "cluster": {"server": self.server, "certificate-authority-data": b64(self.ca_file)}}],
            "users": [{"name": "admin", "user": {"client-certificate-data": b64(self.admin_cert),
                                                 "client-key-data": b64(self.admin_key)}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "admin", "namespace": "default"}}],
        }
        Path(self.kubeconfig).write_text(yaml.safe_dump(cfg))

    # ---- processes ----

    def start(self) -> ControlPlane:
        self.start_etcd()
        self.start_apiserver()
        return self

    def start_etcd(self) -> None:
        data = self.dir / "etcd-data"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        cmd = [str(self.bins["etcd"]), "--name", "e2e", "--data-dir", str(data),
               "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
               "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"e2e={peer}", "--unsafe-no-fsync", "--log-level", "warn"]
        self.etcd_proc = self._spawn(cmd, self.etcd_log)
        import urllib.request

        def healthy() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"

        started_ready("etcd", healthy, 30, self.etcd_proc, self.etcd_log, every=0.2)

    def start_apiserver(self, extra: list[str] | None = None) -> None:
        cmd = [str(self.bins["kube-apiserver"]),
               "--etcd-servers", f"http://127.0.0.1:{self.etcd_port}",
               "--bind-address", self.address, "--advertise-address", self.address, "--secure-port", str(self.port),
               "--tls-cert-file", self.tls_cert, "--tls-private-key-file", self.tls_key,
               "--client-ca-file", self.ca_file,
               "--service-account-key-file", self.sa_pub, "--service-account-signing-key-file", self.sa_key,
               "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
               "--service-cluster-ip-range", self.service_cidr,
               "--authorization-mode", "Node,RBAC",
               "--admission-control-config-file", self.admission_config,
               "--enable-priority-and-fairness=false",
               # Loopback cannot be a Service endpoint: no reconciler then (and no pod could reach it anyway).
               "--endpoint-reconciler-type", "none" if self.address.startswith("127.") else "lease",
               "--cert-dir", str(self.dir / "apiserver-certs"),
               "--v", "1", *self.extra_args, *(extra or [])]
        self._apiserver_extra = extra
        self.apiserver_proc = self._spawn(cmd, self.apiserver_log, append=True)
        self.wait_ready()

    def wait_ready(self, timeout: float = 90) -> None:
        def ready() -> bool:  # TimeoutExpired: a starting API server may hold a connection without answering
            got = self.kubectl("get", "--raw", "/readyz", check=False, timeout=10)
            return got.returncode == 0 and got.stdout.strip() == "ok"

        started_ready("kube-apiserver", ready, timeout, self.apiserver_proc, self.apiserver_log)

    def restart_apiserver(self, down_for: float = 0) -> None:
        stop(self.apiserver_proc)
        time.sleep(down_for)
        self.start_apiserver(self._apiserver_extra)

    def stop(self, grace: float = 15) -> None:
        for proc in (self.apiserver_proc, self.etcd_proc):
            if proc is not None:
                stop(proc, grace)

    def _spawn(self, cmd: list[str], log: Path, append: bool = False) -> subprocess.Popen:
        env = {**os.environ, **self.go_env}
        with open(log, "ab" if append else "wb") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    # ---- kubectl ----

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60):
        got = subprocess.run([self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args], input=stdin,
                             capture_output=True, text=True, timeout=timeout)
        if check and got.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({got.returncode}):\n{got.stdout}\n{got.stderr}")
        return got

    def kubectl_follow(self, *args: str, out, stderr: int | None = subprocess.STDOUT) -> subprocess.Popen:
        """A long-running kubectl (`get --watch`, `logs -f`) writing to the file `out`, in its own session (stop it
        with tests.process.stop): the one way a test follows something with kubectl."""
        return subprocess.Popen([self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args], stdout=out,
                                stderr=stderr, start_new_session=True)

    def apply(self, doc: dict | str, *flags: str, check: bool = True):
        text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
        return self.kubectl("apply", "-f", "-", *flags, stdin=text, check=check)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict | None:
        """The object as JSON (None when it does not exist), read through the Python client: a test polls it, and
        a kubectl process per poll cost ~0.2 s of a core. `kind` as kubectl takes it: "pod", "Pod", "pods"."""
        prefix, plural, namespaced = resource(kind)
        path = f"{prefix}/namespaces/{namespace or 'default'}/{plural}/{name}" if namespaced else \
            f"{prefix}/{plural}/{name}"
        api = self.client()
        got = api.call_api("GET", api.configuration.host + path, header_params={"Accept": "application/json"},
                           _request_timeout=30)
        if got.status == 404:
            return None
        if got.status != 200:
            raise AssertionError(f"GET {path}: {got.status} {got.read()[:500]!r}")
        return json.loads(got.read())

    def client(self):
        """The `kubernetes` client's ApiClient for this API server (made once)."""
        if getattr(self, "_client", None) is None:
            from kubernetes import config

            self._client = config.new_client_from_config(config_file=self.kubeconfig)
        return self._client

    def install_crds(self, paths: list[Path]) -> None:
        # Trainer's CRDs are over the last-applied annotation's size: apply them server-side.
        for p in paths:
            self.kubectl("apply", "--server-side", "-f", str(p))
        for p in paths:
            name = yaml.safe_load(p.read_text())["metadata"]["name"]
            self.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", f"crd/{name}")


def logs_since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""

