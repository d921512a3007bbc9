"""A real one-node cluster for the end-to-end suite: containerd + runc + CNI + kubelet, the scheduler, the
controller manager (the Job controller), kube-proxy, and JobSet's controller, beside the loopback control
plane of cluster.py. Every binary is built from a pinned Go module by toolchain.py; nothing is pulled from
outside this machine (the sandbox image comes from the local registry of registry.py).

Facts this is built on (found on the machine the suite was first run on): this VM lacks CAP_SYS_RESOURCE, so containerd
runs with `restrict_oom_score_adj = true`; it has cgroup v1 hierarchies, so the kubelet runs with
`failCgroupV1: false` and the cgroupfs driver; there is no swap.

Network: a bridge the harness makes (`dspe2e0`) holds the node address (NODE_IP) and is the pods' gateway;
the pod CIDR and the Service CIDR are private to this machine. kube-apiserver listens on NODE_IP (so pods
reach it through the `kubernetes` Service, by kube-proxy), the kubelet too; the rest on 127.0.0.1. Pods
get no default route (only the Service CIDR via the bridge); guard chains drop anything forwarded from or to
the pod CIDR through another interface (DISPATCH-E2E-FWD), and anything reaching NODE_IP or the pod CIDR
from outside the bridge and loopback (DISPATCH-E2E-IN). Nothing is routed off this machine.

Host state: HostState records what the node changes (sysctls, iptables chains and rules, cgroups, dirs) and
puts it back. Teardown runs in the order the notes give: the pods removed, the kubelet stopped, the
sandboxes removed, containerd stopped, then mounts, the bridge, cgroups, chains, sysctls and dirs.

One node at a time on a machine: a file lock serialises sessions (another agent's, or CI's).

A second node (`add_node`, issue 50: the two-node suite) is a second containerd and kubelet of the same
session, beside the first: its own work dir (containerd root, state, sockets, runc root, NRI socket; the
kubelet's root dir, ports, certificate), node name, address and pod CIDR (PLACES), and its own cgroup root
(`/dispatch-e2e-node-2` in every hierarchy: a kubelet removes the pod cgroups under its root that it does not
know), and its own bridge (`dspe2e1`, its gateway address and /24: pods of both nodes reach each other through the
host's routing between the bridges, inside the same guard chains). It shares the control plane, the controllers
and the one kube-proxy (both kubelets are on this host's network: one set of Service rules serves them). Shared
by both kubelets, unused here: the device plugins' directory (/var/lib/kubelet/device-plugins, a fixed path).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import fcntl
import ipaddress
import json
import os
import shlex
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.e2e import toolchain
from tests.e2e.cluster import ControlPlane
from tests.e2e.registry import FileEntry, Registry, busybox_layer, write_layer
from tests.process import eventually, free_port, started_ready, stop

NODE_NAME = "dispatch-e2e-node"
BRIDGE = "dspe2e0"
POD_CIDR = "10.217.0.0/24"
SERVICE_CIDR = "10.217.1.0/24"
NODE_IP = "10.217.0.1"
GUARD_CHAIN = "DISPATCH-E2E"


@dataclass(frozen=True)
class Place:
    """Where a node of the harness lives on this machine."""
    name: str
    bridge: str
    pod_cidr: str
    ip: str           # the node address and its pods' gateway, on its bridge
    cgroup_root: str  # the kubelet's cgroupRoot ("" the host's: the first node's kubepods stay where they were)


# The first node is the one-node suites' (unchanged); the second is the two-node suite's.
# A bridge each: CNI's bridge plugin, as the pods' gateway, refuses a bridge holding another IPv4 address.
PLACES = (Place(NODE_NAME, BRIDGE, POD_CIDR, NODE_IP, ""),
          Place("dispatch-e2e-node-2", "dspe2e1", "10.217.2.0/24", "10.217.2.1", "/dispatch-e2e-node-2"))
LOCK = Path("/run/lock/dispatch-admission-e2e-node.lock")

SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
           "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward",
           "net.ipv4.conf.all.route_localnet", "net.bridge.bridge-nf-call-iptables",
           "net.netfilter.nf_conntrack_max")
# Directories outside the node's work dir that the kubelet, containerd or CNI make (fixed paths in their code;
# seen made by a run here: /run/containerd (shim sockets), /var/log/containers, /var/lib/kubelet (device
# plugins), /usr/libexec/kubernetes, /var/lib/cni (libcni's result cache)). Removed only if absent before.
# Not /run/runc: BuildKit (the image suite) uses it, and this node's runc keeps its state under the work dir.
HOST_DIRS = ("/run/containerd", "/var/run/netns", "/run/netns", "/var/log/containers", "/var/log/pods",
             "/var/lib/kubelet", "/usr/libexec/kubernetes", "/var/lib/cni")
CHAIN_MARKERS = ("KUBE-", "CNI-", GUARD_CHAIN)


def _sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    got = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and got.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({got.returncode}): {got.stderr.strip()}")
    return got


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def _mountpoints() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        points.append(line.split()[4].replace("\\040", " "))
    return points


# ---- host state ----

@dataclass
class HostState:
    sysctls: dict[str, str] = field(default_factory=dict)
    iptables: dict[str, dict[str, tuple[set[str], set[str]]]] = field(default_factory=dict)
    dirs: dict[str, bool] = field(default_factory=dict)
    cgroups: dict[str, bool] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)

    @classmethod
    def record(cls) -> HostState:
        state = cls()
        for name in SYSCTLS:
            p = _sysctl_path(name)
            if p.exists():
                state.sysctls[name] = p.read_text().strip()
        for tool in ("iptables", "ip6tables"):
            state.iptables[tool] = _iptables_rules(tool)
        for d in HOST_DIRS:
            state.dirs[d] = os.path.lexists(d)
        for root in _cgroup_roots():
            state.cgroups[str(root / "kubepods")] = (root / "kubepods").exists()
        return state

    def restore(self) -> list[str]:
        """Undo what the node changed; return what could not be undone (for the report)."""
        problems: list[str] = []
        for path, existed in self.cgroups.items():
            if not existed and os.path.exists(path):
                problems += _rmdir_cgroup(Path(path))
        for tool, before in self.iptables.items():
            problems += _restore_iptables(tool, before)
        for name, value in self.sysctls.items():
            p = _sysctl_path(name)
            try:
                if p.exists() and p.read_text().strip() != value:
                    p.write_text(value)
            except OSError as e:
                problems.append(f"sysctl {name}: {e}")
        for d, existed in self.dirs.items():
            if not existed and os.path.lexists(d):
                if any(m == d or m.startswith(d + "/") for m in _mountpoints()):
                    problems.append(f"{d}: still has mounts, left in place")
                    continue
                _sh("rm", "-rf", "--one-file-system", d, check=False)
        return problems


def _cgroup_roots() -> list[Path]:
    roots = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        parts = line.split()
        fstype = parts[parts.index("-") + 1]
        if fstype in ("cgroup", "cgroup2") and parts[4].startswith("/sys/fs/cgroup"):
            roots.append(Path(parts[4]))
    return roots


def _rmdir_cgroup(top: Path) -> list[str]:
    problems = []
    for dirpath, _dirnames, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
        try:
            os.rmdir(dirpath)
        except OSError as e:
            problems.append(f"cgroup {dirpath}: {e}")
    return problems[:5]


def _iptables_rules(tool: str) -> dict[str, tuple[set[str], set[str]]]:
    got = subprocess.run([f"{tool}-save"], capture_output=True, text=True)
    tables: dict[str, tuple[set[str], set[str]]] = {}
    table = None
    for line in got.stdout.splitlines():
        if line.startswith("*"):
            table = line[1:]
            tables[table] = (set(), set())
        elif line.startswith(":") and table:
            tables[table][0].add(line[1:].split()[0])
        elif line.startswith("-A ") and table:
            tables[table][1].add(line)
    return tables


def _restore_iptables(tool: str, before: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """Delete the rules and chains the node added (those naming KUBE-, CNI- or our guard chain)."""
    after = _iptables_rules(tool)
    problems = []
    for table, (chains, rules) in after.items():
        old_chains, old_rules = before.get(table, (set(), set()))
        new_chains = [c for c in chains - old_chains if c.startswith(CHAIN_MARKERS)]
        for rule in sorted(rules - old_rules):
            args = shlex.split(rule)
            if args[1] in new_chains or not any(m in rule for m in CHAIN_MARKERS + (BRIDGE, POD_CIDR)):
                continue
            got = subprocess.run([tool, "-w", "-t", table, "-D", *args[1:]], capture_output=True, text=True)
            if got.returncode != 0:
                problems.append(f"{tool} -t {table} -D {' '.join(args[1:])}: {got.stderr.strip()}")
        for chain in new_chains:
            subprocess.run([tool, "-w", "-t", table, "-F", chain], capture_output=True)
        for chain in new_chains:
            got = subprocess.run([tool, "-w", "-t", table, "-X", chain], capture_output=True, text=True)
            if got.returncode != 0:
                problems.append(f"{tool} -t {table} -X {chain}: {got.stderr.strip()}")
    return problems


# ---- identities ----

def identity(cluster: ControlPlane, name: str, cn: str, orgs: tuple[str, ...] = (),
             server_names: tuple[str, ...] = ()) -> tuple[str, str]:
    """A client (and optionally serving) certificate signed by the cluster CA: (cert file, key file)."""
    ca_key, ca_cert = cluster._ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([*(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs),
                         x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server_names else [])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if server_names:
        sans = []
        for n in server_names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    from cryptography.hazmat.primitives import serialization

    pki = cluster.dir / "pki"
    cert_path, key_path = pki / f"{name}.crt", pki / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def kubeconfig_for(cluster: ControlPlane, name: str, cert: str, key: str) -> str:
    def b64(path):
        return base64.b64encode(Path(path).read_bytes()).decode()

    path = cluster.dir / f"{name}.kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": name,
        "clusters": [{"name": "e2e",
                      "cluster": {"server": cluster.server, "certificate-authority-data": b64(cluster.ca_file)}}],
        "users": [{"name": name, "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)}}],
        "contexts": [{"name": name, "context": {"cluster": "e2e", "user": name}}]}))
    return str(path)


# ---- images ----

@dataclass
class Images:
    pause: str
    publish: str
    training: str
    copier: str


def build_images(registry: Registry, workdir: Path) -> Images:
    """The node's images, by digest: the sandbox (pause stand-in), the publish image (exactly one file,
    `publish`, at its root), a training image (busybox-static), and route 2's copier (busybox + publish,
    whose command copies the binary to $DISPATCH_PUBLISH_DEST/publish)."""
    workdir.mkdir(parents=True, exist_ok=True)
    publish_bin, pause_bin = toolchain.stub_bin("publish"), toolchain.stub_bin("pause")
    pause_layer = write_layer(workdir / "pause.tar", {"pause": FileEntry(source=pause_bin, mode=0o755)})
    publish_layer = write_layer(workdir / "publish.tar", {"publish": FileEntry(source=publish_bin, mode=0o755)})
    shell = busybox_layer(workdir / "busybox.tar")
    return Images(
        pause=registry.push_layers("e2e/pause", [pause_layer], entrypoint=["/pause"], user="65535"),
        publish=registry.push_layers("dispatch/publish", [publish_layer]),
        training=registry.push_layers("e2e/training", [shell], cmd=["/bin/sh"], env={"PATH": "/bin"}),
        copier=registry.push_layers("e2e/publish-copier", [shell, publish_layer], env={"PATH": "/bin"},
                                    cmd=["/bin/sh", "-c", 'cp /publish "$DISPATCH_PUBLISH_DEST/publish"']),
    )


# ---- the node ----

def _https_ok(url: str) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
        return r.status == 200


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def _guards(place: Place) -> dict[str, tuple[str, list[list[str]], list[list[str]]]]:
    """The guard chains' rules for a node, (chain, accepts, drops) by parent chain: delivered here, only from
    loopback or a node's bridge may anything reach the node address or its pods; routed, pod to pod between the
    nodes' bridges only: nothing from the pod CIDR out through another interface, nothing from outside in. A later
    node's rules go into the first's chains (its accepts first)."""
    br, first = place.bridge, PLACES[0].bridge
    ins_accept = [["-i", br, "-j", "RETURN"]]
    fwd_accept = [["-i", br, "-o", br, "-j", "RETURN"]]
    if place == PLACES[0]:
        ins_accept = [["-i", "lo", "-j", "RETURN"], *ins_accept]
    else:
        fwd_accept += [["-i", br, "-o", first, "-j", "RETURN"], ["-i", first, "-o", br, "-j", "RETURN"]]
    ins_drop = [["-d", place.ip, "-j", "DROP"], ["-d", place.pod_cidr, "-j", "DROP"]]
    fwd_drop = [["-s", place.pod_cidr, "-j", "DROP"], ["-d", place.pod_cidr, "-j", "DROP"],
                ["-i", br, "-j", "DROP"], ["-o", br, "-j", "DROP"]]
    return {"INPUT": (f"{GUARD_CHAIN}-IN", ins_accept, ins_drop),
            "FORWARD": (f"{GUARD_CHAIN}-FWD", fwd_accept, fwd_drop)}


class Node:
    """The node's processes and host changes; `start_network()` before the control plane starts (its
    address lives on the bridge), `start()` after, `stop()` always."""

    def __init__(self, workdir: Path, proxy: bool = True, index: int = 0):
        """`index` picks the node's place (PLACES): 0 runs the cluster's controllers and kube-proxy too."""
        self.place = PLACES[index]
        self.first = index == 0
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bins = toolchain.node_bins()
        self.proxy = proxy
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.host: HostState | None = None
        self._lock = None
        self.problems: list[str] = []
        self.containerd_sock = self.dir / "containerd" / "containerd.sock"
        self.kubelet_port, self.kubelet_healthz = free_port(), free_port()

    # -- lock and host network --

    def acquire(self, timeout: float = 1800) -> None:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(LOCK, "w")

        def locked() -> bool:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

        eventually(locked, f"{LOCK} free (another e2e node holds it)", timeout, every=2)

    def start_network(self) -> None:
        """The first node: the bridge, its address, the guard chains. A later node: its address on the bridge and
        its ranges in the guard chains (the first node's teardown takes the chains and the bridge)."""
        if self.first:
            self.host = HostState.record()
        for net in ((POD_CIDR, SERVICE_CIDR) if self.first else (self.place.pod_cidr,)):
            for route in json.loads(_sh("ip", "-j", "route", "show", "table", "all").stdout or "[]"):
                dst = route.get("dst", "")
                if dst in ("default", "") or route.get("dev") == self.place.bridge:
                    continue
                try:
                    if ipaddress.ip_network(dst, strict=False).overlaps(ipaddress.ip_network(net)):
                        raise RuntimeError(f"{net} overlaps this machine's route {dst}: pick another range")
                except ValueError:
                    pass
        bridge = self.place.bridge
        if _sh("ip", "link", "show", bridge, check=False).returncode != 0:
            _sh("ip", "link", "add", bridge, "type", "bridge")
        prefix = ipaddress.ip_network(self.place.pod_cidr).prefixlen
        _sh("ip", "addr", "replace", f"{self.place.ip}/{prefix}", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        ipt = ["iptables", "-w"]
        for parent, (chain, accepts, drops) in _guards(self.place).items():
            if self.first:
                _sh(*ipt, "-N", chain, check=False)
                _sh(*ipt, "-F", chain)
            for rule in accepts:  # a later node's before the first's drops
                _sh(*ipt, "-A" if self.first else "-I", chain, *([] if self.first else ["1"]), *rule)
            for rule in drops:
                _sh(*ipt, "-A", chain, *rule)
            if self.first and _sh(*ipt, "-C", parent, "-j", chain, check=False).returncode != 0:
                _sh(*ipt, "-I", parent, "1", "-j", chain)

    def _stop_network(self) -> None:
        """A later node's part of the network undone: its guard rules and its bridge (the first node's teardown
        takes the chains)."""
        for _parent, (chain, accepts, drops) in _guards(self.place).items():
            for rule in accepts + drops:
                _sh("iptables", "-w", "-D", chain, *rule, check=False)
        _sh("ip", "link", "del", self.place.bridge, check=False)

    # -- processes --

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = self.dir / f"{name}.log"
        self.logs[name] = log
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **(env or {})})
        self.procs[name] = proc
        return proc

    def start(self, cluster: ControlPlane, registry: Registry, images: Images) -> None:
        self.cluster = cluster
        self.images = images
        self.registry = registry
        self._start_containerd(registry, images)
        self._start_kubelet(cluster)
        if self.first:
            self._start_controllers(cluster)

    def _start_containerd(self, registry: Registry, images: Images) -> None:
        base = self.dir / "containerd"
        self.pull_from(registry.host, registry.host)
        cni_conf = base / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-dispatch-e2e.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "dispatch-e2e",
            "plugins": [{"type": "bridge", "bridge": self.place.bridge, "isGateway": True, "ipMasq": False,
                         "hairpinMode": True,
                         "ipam": {"type": "host-local", "dataDir": str(base / "ipam"),
                                  "ranges": [[{"subnet": self.place.pod_cidr, "gateway": self.place.ip}]],
                                  # the Services, and the other nodes' pods through the host
                                  "routes": [{"dst": SERVICE_CIDR}, *({"dst": p.pod_cidr} for p in PLACES
                                                                      if p != self.place)]}}]}))
        bindir = self.bins["containerd"].parent
        config = base / "config.toml"
        config.write_text(f"""version = 3
root = "{base / 'root'}"
state = "{base / 'state'}"

[grpc]
  address = "{self.containerd_sock}"

[ttrpc]
  address = "{base / 'containerd.sock.ttrpc'}"

[debug]
  level = "info"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{self.bins['runc']}"
        Root = "{base / 'runc'}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{self.bins['cni']}"]
    conf_dir = "{cni_conf}"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{images.pause}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{base / 'certs.d'}"

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.transfer.v1.local"]
  config_path = "{base / 'certs.d'}"

# its own (the default, /var/run/nri/nri.sock, is one per machine: a second containerd took it over)
[plugins."io.containerd.nri.v1.nri"]
  socket_path = "{base / 'nri.sock'}"
""")
        # containerd finds containerd-shim-runc-v2 (and the shim finds runc) on PATH.
        path = f"{bindir}:{self.bins['runc'].parent}:/usr/sbin:/usr/bin:/sbin:/bin"
        proc = self._spawn("containerd", [str(self.bins["containerd"]), "--config", str(config)], env={"PATH": path})
        started_ready("containerd", lambda: self.ctr("version").returncode == 0, 60, proc, self.logs["containerd"])

    def pull_from(self, host: str, server: str) -> None:
        """Where this node's containerd pulls images named `host/...` from: `server`, a registry on loopback
        speaking plain HTTP (its hosts.toml, read at each pull: no restart). The node's registry itself, or a
        mirror (the two-node suite's node that cannot pull the publish image)."""
        hosts = self.dir / "containerd" / "certs.d" / host
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(
            f'server = "http://{server}"\n\n[host."http://{server}"]\n'
            '  capabilities = ["pull", "resolve"]\n  skip_verify = true\n')

    def ctr(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bins["ctr"]), "--address", str(self.containerd_sock), *args],
                              capture_output=True, text=True, timeout=60)

    def crictl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        endpoint = f"unix://{self.containerd_sock}"
        return subprocess.run([str(self.bins["crictl"]), "--runtime-endpoint", endpoint, "--image-endpoint",
                               endpoint, "--timeout", "30s", *args], capture_output=True, text=True, timeout=timeout)

    def _start_kubelet(self, cluster: ControlPlane) -> None:
        base = self.dir / "kubelet"
        base.mkdir(parents=True, exist_ok=True)
        me = "kubelet" if self.first else f"kubelet-{self.place.name}"
        cert, key = identity(cluster, me, f"system:node:{self.place.name}", ("system:nodes",),
                             server_names=(self.place.ip, self.place.name))
        kubeconfig = kubeconfig_for(cluster, me, cert, key)
        if self.place.cgroup_root:  # the kubelet wants its cgroup root in every hierarchy before it starts
            self._make_cgroup_root()
        config = base / "config.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.place.ip, "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.kubelet_healthz,
            "tlsCertFile": cert, "tlsPrivateKeyFile": key,
            "authentication": {"x509": {"clientCAFile": cluster.ca_file}, "webhook": {"enabled": True},
                               "anonymous": {"enabled": False}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
            **({"cgroupRoot": self.place.cgroup_root} if self.place.cgroup_root else {}),
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "imageServiceEndpoint": f"unix://{self.containerd_sock}",
            "volumePluginDir": str(base / "volume-plugins"), "podLogsDir": str(self.dir / "pod-logs"),
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                             "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False, "maxPods": 40, "resolvConf": "",
            "clusterDomain": "cluster.local", "registerNode": True,
            "nodeStatusUpdateFrequency": "5s", "syncFrequency": "10s",
            "fileCheckFrequency": "5s", "shutdownGracePeriod": "0s",
            "localStorageCapacityIsolation": True,  # ephemeral-storage requests and limits, as real nodes keep them
        }))
        proc = self._spawn("kubelet", [str(self.bins["kubelet"]), "--config", str(config), "--kubeconfig", kubeconfig,
                                       "--root-dir", str(base / "root"), "--hostname-override", self.place.name,
                                       "--node-ip", self.place.ip, "--v", "2"],
                           env={"PATH": f"{self.bins['runc'].parent}:/usr/sbin:/usr/bin:/sbin:/bin"})
        started_ready("the node", lambda: self.node_ready(cluster), 180, proc, self.logs["kubelet"])

    def node_ready(self, cluster: ControlPlane) -> bool:
        node = cluster.get("node", self.place.name)
        return bool(node) and any(c["type"] == "Ready" and c["status"] == "True"
                                  for c in node.get("status", {}).get("conditions", []))

    def _cgroup_dirs(self) -> list[Path]:
        return [root / self.place.cgroup_root.strip("/") for root in _cgroup_roots()]

    def _make_cgroup_root(self) -> None:
        for path in self._cgroup_dirs():
            path.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):  # cgroup v1's cpuset: empty until copied from the parent
                if (path / name).exists() and not (path / name).read_text().strip():
                    (path / name).write_text((path.parent / name).read_text())

    def _start_controllers(self, cluster: ControlPlane) -> None:
        kcm_cert = identity(cluster, "kcm", "system:kube-controller-manager")
        kcm_port = free_port()
        proc = self._spawn("kube-controller-manager", [
            str(self.bins["kube-controller-manager"]),
            "--kubeconfig", kubeconfig_for(cluster, "kcm", *kcm_cert),
            "--bind-address", "127.0.0.1", "--secure-port", str(kcm_port),
            "--service-account-private-key-file", cluster.sa_key, "--root-ca-file", cluster.ca_file,
            "--use-service-account-credentials=true", "--leader-elect=false",
            "--cluster-cidr", POD_CIDR, "--service-cluster-ip-range", SERVICE_CIDR, "--allocate-node-cidrs=false",
            "--controllers", "*",
            "--concurrent-job-syncs", "5", "--v", "1"])
        started_ready("kube-controller-manager", lambda: _https_ok(f"https://127.0.0.1:{kcm_port}/healthz"), 90, proc,
              self.logs["kube-controller-manager"])
        sched_cert = identity(cluster, "scheduler", "system:kube-scheduler")
        sched_port = free_port()
        proc = self._spawn("kube-scheduler", [
            str(self.bins["kube-scheduler"]), "--kubeconfig", kubeconfig_for(cluster, "scheduler", *sched_cert),
            "--bind-address", "127.0.0.1", "--secure-port", str(sched_port), "--leader-elect=false", "--v", "1"])
        started_ready("kube-scheduler", lambda: _https_ok(f"https://127.0.0.1:{sched_port}/healthz"), 90, proc,
              self.logs["kube-scheduler"])
        if self.proxy:
            proxy_cert = identity(cluster, "kube-proxy", "system:kube-proxy")
            health = free_port()
            proc = self._spawn("kube-proxy", [
                str(self.bins["kube-proxy"]), "--kubeconfig", kubeconfig_for(cluster, "kube-proxy", *proxy_cert),
                "--hostname-override", NODE_NAME, "--proxy-mode", "iptables", "--cluster-cidr", POD_CIDR,
                "--healthz-bind-address", f"127.0.0.1:{health}", "--metrics-bind-address", f"127.0.0.1:{free_port()}",
                "--nodeport-addresses", f"{NODE_IP}/32",
                # leave the host's conntrack settings alone
                "--conntrack-max-per-core", "0", "--conntrack-tcp-timeout-established", "0",
                "--conntrack-tcp-timeout-close-wait", "0", "--v", "1"])
            started_ready("kube-proxy", lambda: _http_ok(f"http://127.0.0.1:{health}/healthz"), 90, proc,
                  self.logs["kube-proxy"])
        self._start_jobset(cluster)

    def _start_jobset(self, cluster: ControlPlane) -> None:
        from webhook import certs

        base = self.dir / "jobset"
        cert_dir = base / "certs"
        certs.write_dev_pair(cert_dir, ["localhost", "127.0.0.1"])
        port, health = free_port(), free_port()
        config = base / "config.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
            "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
            "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(cert_dir)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"}}))
        proc = self._spawn("jobset-controller-manager", [
            str(self.bins["jobset-controller-manager"]), f"--config={config}", "--zap-log-level=info"],
            env={"KUBECONFIG": cluster.kubeconfig, "HOME": str(base)})
        started_ready("jobset-controller-manager", lambda: _http_ok(f"http://127.0.0.1:{health}/readyz"), 120, proc,
              self.logs["jobset-controller-manager"])
        jobset = toolchain.module_dir("sigs.k8s.io/jobset", toolchain.JOBSET)
        manifest = jobset / "config" / "components" / "webhook" / "manifests.yaml"
        ca = base64.b64encode((cert_dir / "ca.crt").read_bytes()).decode()
        for doc in [d for d in yaml.safe_load_all(manifest.read_text()) if d]:
            doc["metadata"]["name"] = "jobset-" + doc["metadata"]["name"]
            for w in doc["webhooks"]:
                w["clientConfig"] = {"url": f"https://127.0.0.1:{port}{w['clientConfig']['service']['path']}",
                                     "caBundle": ca}
                if w["rules"][0]["resources"] == ["pods"]:  # as JobSet's kustomize patches do
                    w["objectSelector"] = {"matchExpressions": [
                        {"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}
            cluster.apply(doc)

    # -- teardown --

    def stop(self) -> list[str]:
        """Stop everything in the notes' order and restore the host; returns problems met (also kept in
        self.problems)."""
        if getattr(self, "_stopped", False):
            return self.problems
        self._stopped = True
        problems = self.problems
        cluster = getattr(self, "cluster", None)
        if not self.first:
            return self._stop_later_node(cluster)
        if cluster is not None and "kubelet" in self.procs and self.procs["kubelet"].poll() is None:
            # The workloads go first, while the Job controller and the garbage collector still run (pods carry
            # the Job controller's tracking finalizer): no webhook may block it (the harness's webhook servers
            # are stopped by now), then TrainJobs, JobSets and Jobs cascade, then whatever pods remain.
            for args in (("delete", "mutatingwebhookconfigurations,validatingwebhookconfigurations", "--all"),
                         ("delete", "trainjobs.trainer.kubeflow.org", "--all", "-A", "--wait=false"),
                         ("delete", "jobsets.jobset.x-k8s.io", "--all", "-A", "--cascade=foreground", "--timeout=90s"),
                         ("delete", "jobs", "--all", "-A", "--cascade=foreground", "--timeout=90s"),
                         ("delete", "pods", "--all", "-A", "--grace-period=1", "--timeout=90s")):
                got = cluster.kubectl(*args, check=False, timeout=120)
                if got.returncode != 0 and "the server doesn't have a resource type" not in got.stderr:
                    problems.append(f"kubectl {' '.join(args)}: {got.stderr.strip()[-500:]}")
        for name in ("jobset-controller-manager", "kube-controller-manager", "kube-scheduler"):
            if name in self.procs:
                stop(self.procs[name])
        self._stop_runtime()
        if "kube-proxy" in self.procs:
            stop(self.procs["kube-proxy"])
        self._kill_shims()
        self._unmount_all()
        _sh("ip", "link", "del", BRIDGE, check=False)
        if self.host is not None:
            made = [d for d, existed in self.host.dirs.items() if not existed and os.path.lexists(d)]
            (self.dir / "host-changes.txt").write_text(
                "directories made outside the work dir: " + " ".join(made) + "\n" +
                "sysctls before: " + json.dumps(self.host.sysctls) + "\n" +
                "sysctls at teardown: " + json.dumps({n: _sysctl_path(n).read_text().strip()
                                                      for n in self.host.sysctls if _sysctl_path(n).exists()}) + "\n")
            problems += self.host.restore()
        for name, proc in self.procs.items():
            if proc.poll() is None:
                problems.append(f"{name} still running")
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None
        return problems

    def _stop_runtime(self) -> None:
        """The kubelet stopped, then the sandboxes removed and containerd stopped."""
        if "kubelet" in self.procs:
            stop(self.procs["kubelet"])
        if "containerd" in self.procs and self.procs["containerd"].poll() is None:
            for pod in self.crictl("pods", "-q").stdout.split():
                self.crictl("stopp", pod)
                self.crictl("rmp", "-f", pod)
            stop(self.procs["containerd"], timeout=30)

    def _stop_later_node(self, cluster: ControlPlane | None) -> list[str]:
        """A later node leaves the cluster: its pods deleted while its kubelet runs, its runtime stopped, its
        Node object deleted, then its mounts, cgroups and network undone (the first node's teardown takes the rest
        of the host's state, and holds the lock)."""
        problems = self.problems
        if cluster is not None and "kubelet" in self.procs and self.procs["kubelet"].poll() is None:
            got = cluster.kubectl("delete", "pods", "-A", "--field-selector", f"spec.nodeName={self.place.name}",
                                  "--grace-period=1", "--timeout=90s", check=False, timeout=120)
            if got.returncode != 0:
                problems.append(f"pods of {self.place.name}: {got.stderr.strip()[-500:]}")
        self._stop_runtime()
        if cluster is not None:
            cluster.kubectl("delete", "node", self.place.name, "--ignore-not-found", check=False)
            cluster.kubectl("delete", "pods", "-A", "--field-selector", f"spec.nodeName={self.place.name}",
                            "--force", "--grace-period=0", check=False)
        self._kill_shims()
        self._unmount_all()
        for path in self._cgroup_dirs():
            if path.exists():
                problems += _rmdir_cgroup(path)
        self._stop_network()
        for name, proc in self.procs.items():
            if proc.poll() is None:
                problems.append(f"{name} still running")
        return problems

    def _kill_shims(self) -> None:
        """containerd-shim-runc-v2 processes re-parent to init: end those started from our binary for this node's
        containerd (its socket is in their command line; another node's shims run the same binary), by pid."""
        for pid in self._shims():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        try:
            eventually(lambda: not self._shims(), "the shims gone", 10, every=0.2)
        except AssertionError:
            self.problems.append(f"shims still running: {self._shims()}")

    def _shims(self) -> list[str]:
        shim, address = str(self.bins["containerd-shim-runc-v2"]), str(self.containerd_sock).encode()
        found = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                if os.readlink(f"/proc/{pid}/exe") == shim and address in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                pass
        return found

    def _unmount_all(self) -> None:
        mine = str(self.dir.resolve())
        for point in sorted((m for m in _mountpoints() if m == mine or m.startswith(mine + "/")),
                            key=lambda m: -m.count("/")):
            got = subprocess.run(["umount", point], capture_output=True, text=True)
            if got.returncode != 0:
                got = subprocess.run(["umount", "-l", point], capture_output=True, text=True)
                if got.returncode != 0:
                    self.problems.append(f"umount {point}: {got.stderr.strip()}")


@dataclass
class NodeCluster:
    cluster: ControlPlane
    node: Node
    registry: Registry
    images: Images
    # Clean-ups a suite owes the node's next user, paid when a suite next takes the node (`settle`) and dropped
    # when the node stops, its etcd and containers going with it: the memory test's 10,000 runtimes and the
    # hostile tenant's namespace took ~2 min of the API server to delete, for nobody when test_install ran last.
    owed: list[tuple[str, Callable[[], None]]] = field(default_factory=list)

    def owe(self, what: str, clean_up: Callable[[], None]) -> None:
        self.owed.append((what, clean_up))

    def settle(self) -> None:
        """Pays what earlier suites owe, first owed first, before a suite uses the node."""
        while self.owed:
            what, clean_up = self.owed.pop(0)
            started = time.monotonic()
            clean_up()
            print(f"\nowed to the node, paid: {what} ({time.monotonic() - started:.0f}s)")


def start_node_cluster(stack: contextlib.ExitStack, tmp: Path, crds: list[Path], logs: dict[str, Path] | None = None,
                       proxy: bool = True) -> NodeCluster:
    """The whole one-node cluster, stopped with `stack`: the bridge, etcd and kube-apiserver on the node
    address, `crds` installed, the local registry with the node's images, containerd, the kubelet, the
    scheduler, the controller manager, kube-proxy and JobSet's controller (with its webhooks). `logs` gets
    every process's log file, for the failure report."""
    logs = logs if logs is not None else {}
    node = Node(tmp / "node", proxy=proxy)
    node.acquire()
    cluster = ControlPlane(tmp / "control-plane", address=NODE_IP, service_cidr=SERVICE_CIDR)
    apiserver_client = identity(cluster, "apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                ("system:masters",))
    cluster.extra_args += ["--kubelet-client-certificate", apiserver_client[0],
                           "--kubelet-client-key", apiserver_client[1],
                           "--kubelet-preferred-address-types", "InternalIP",
                           "--enable-aggregator-routing=true"]
    # A quarter of the garbage collections: a CPU profile of this API server under the hostile tenant had ~20% of
    # its time in the collector, and this machine has memory (24 GiB) where it is short of cores. GOMEMLIMIT bounds
    # it (the API server reached 5.9 GiB RSS with GOGC alone). Only here: the benchmarks' API servers stay stock.
    cluster.go_env = {"GOGC": "400", "GOMEMLIMIT": "4GiB"}
    # Killed after 2 s: on SIGTERM this API server's lease reconciler held its exit for the whole 15 s (seen
    # 2026-12-05; one on loopback, without it, exits in 1 s), and nobody reads this etcd after.
    stack.callback(cluster.stop, grace=2)
    registry = Registry.start(tmp / "registry")
    stack.callback(registry.stop)
    stack.callback(node.stop)  # runs first: it needs the API server and the registry
    logs["etcd (node)"], logs["kube-apiserver (node)"] = cluster.etcd_log, cluster.apiserver_log
    logs["registry (node)"] = registry.log
    node.start_network()
    cluster.start()
    cluster.install_crds(crds)
    images = build_images(registry, tmp / "images")
    try:
        node.start(cluster, registry, images)
    finally:
        logs.update(node.logs)
    return NodeCluster(cluster, node, registry, images)


def add_node(stack: contextlib.ExitStack, nc: NodeCluster, workdir: Path, index: int = 1,
             logs: dict[str, Path] | None = None) -> Node:
    """A further node of `nc`'s cluster (PLACES[index]): its containerd and kubelet, Ready; it leaves the cluster
    (pods, Node object, host changes) with `stack`, before the first node's teardown."""
    node = Node(workdir, proxy=False, index=index)
    stack.callback(node.stop)
    node.start_network()
    try:
        node.start(nc.cluster, nc.registry, nc.images)
    finally:
        if logs is not None:
            logs.update({f"{k} ({node.place.name})": v for k, v in node.logs.items()})
    return node
