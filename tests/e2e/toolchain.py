"""Build and cache the end-to-end binaries from pinned Go modules.

No Docker, kind or prebuilt Kubernetes binaries can be had here, only the Go module proxy, so
kube-apiserver, kubectl, etcd and helm are built from source once and cached per pinned version
in a user-level directory (a fresh clone reuses them). Trainer's CRDs come from its Go module.

Run `python -m tests.e2e.toolchain` to build everything ahead of the tests (`--fetch-only`: download the
modules, compile nothing). It fetches the recipes' modules side by side (DISPATCH_E2E_FETCH_JOBS at a time, 4
by default: the downloads wait on the network) and compiles DISPATCH_E2E_BUILD_JOBS recipes at once (2: each
`go build` already uses every core); versions and go.sum's checks are the recipes' own, as one at a time. A
file lock per cache entry makes two processes (pytest-xdist's workers, two checkouts) build an entry once,
the other waiting.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

# The compatibility matrix (`make test-compat`) runs the API-level suite with other versions of these two.
KUBERNETES = os.environ.get("DISPATCH_E2E_KUBERNETES", "v1.37.2")
ETCD = "v3.6.16"
HELM = "v3.22.0"
TRAINER = os.environ.get("DISPATCH_E2E_TRAINER", "v2.3.0")
JOBSET = "v0.12.0"
BUILDKIT = "v0.34.2"
SYFT = "v1.57.1"
KUEUE = "v0.19.2"
OPENREPORTS = "v0.2.1"  # github.com/openreports/reports-api: the Report and ClusterReport CRDs audit --report writes
COSIGN = "v3.1.3"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dispatch-admission" / "e2e"


def _go(args: list[str], cwd: Path, env: dict | None = None) -> str:
    full_env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", **(env or {})}
    proc = subprocess.run(["go", *args], cwd=cwd, env=full_env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"go {' '.join(args)} failed in {cwd}:\n{proc.stderr[-4000:]}")
    return proc.stdout


def module_dir(path: str, version: str) -> Path:
    """Download one module into the module cache and return its directory."""
    scratch = cache_root() / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    if not (scratch / "go.mod").exists():
        (scratch / "go.mod").write_text("module scratch\n\ngo 1.26\n")
    with _FETCHING:
        info = json.loads(_go(["mod", "download", "-json", f"{path}@{version}"], scratch))
    return Path(info["Dir"])


@contextlib.contextmanager
def cache_lock(entry: str):
    """Held while one cache entry is made: another process (an xdist worker, another checkout) or thread
    asking for the same entry waits, then finds it complete."""
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{entry}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _jobs(variable: str, default: int) -> int:
    return max(int(os.environ.get(variable) or default), 1)


# Compiles at once, in this process (main's threads): a `go build` is CPU-bound and uses every core itself.
_COMPILING = threading.BoundedSemaphore(_jobs("DISPATCH_E2E_BUILD_JOBS", 2))
# Module downloads at once (`go mod tidy`, `go mod download`): they wait on the network. Go's module cache
# takes its own locks, so two commands fetching one module share it safely.
_FETCHING = threading.BoundedSemaphore(_jobs("DISPATCH_E2E_FETCH_JOBS", 4))
# `--fetch-only`: every recipe's modules downloaded (into the module cache), nothing compiled or marked complete.
_FETCH_ONLY = threading.Event()


def _build(name: str, gomod: str, packages: list[str], ldflags: str = "", extra_files: dict | None = None,
           tags: str = "", env: dict | None = None, get: list[str] | None = None,
           renames: dict[str, str] | None = None) -> Path:
    """Build `packages` in a throw-away module described by `gomod`; return the bin directory.

    The cache directory is keyed by the pinned version and a hash of the whole recipe, so changing
    any of it rebuilds (quickly: Go's build cache keeps the compiled packages). `renames` (built name: wanted
    name) are applied before the entry is marked complete, so no reader sees it half renamed.
    """
    recipe = [gomod, packages, ldflags, extra_files] + ([tags, env] if tags or env else []) + ([get] if get else [])
    recipe = json.dumps(recipe, sort_keys=True).encode()
    name = f"{name}-{hashlib.sha256(recipe).hexdigest()[:8]}"
    bindir = cache_root() / name / "bin"
    stamp = bindir / ".complete"
    if stamp.exists():
        return bindir
    with cache_lock(name):
        if stamp.exists():  # built by whoever held the lock before us
            return bindir
        work = cache_root() / name / "src"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        (work / "go.mod").write_text(gomod)
        for fname, text in (extra_files or {}).items():
            (work / fname).write_text(text)
        started = time.monotonic()
        with _FETCHING:
            for spec in get or []:  # `go get` of the command package itself, where tidy alone leaves go.sum short
                _go(["get", spec], work)
            _go(["mod", "tidy"], work)  # the downloads, checked against the checksum database into go.sum
        if _FETCH_ONLY.is_set():
            return bindir
        bindir.mkdir(parents=True, exist_ok=True)
        args = ["build", "-trimpath", "-o", str(bindir) + "/"]
        if ldflags:
            args += ["-ldflags", ldflags]
        if tags:
            args += ["-tags", tags]
        with _COMPILING:
            _go(args + packages, work, env)
        for built, wanted in (renames or {}).items():
            if (bindir / built).exists():
                (bindir / built).rename(bindir / wanted)
        stamp.write_text(f"built in {time.monotonic() - started:.0f}s\n")
    return bindir


# One build of every command shares the compile cache: the control plane, the node and the client.
KUBE_COMMANDS = [
    f"k8s.io/kubernetes/cmd/{cmd}"
    for cmd in ("kube-apiserver", "kubectl", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
]


def kube_bin() -> Path:
    """kube-apiserver and kubectl from k8s.io/kubernetes, staging modules pinned to the same release."""
    mod = module_dir("k8s.io/kubernetes", KUBERNETES)
    upstream = (mod / "go.mod").read_text()
    # k8s.io/kubernetes requires its staging repos at v0.0.0 and replaces them with ./staging paths
    # that do not exist in the module zip; point each at the published v0.MINOR.PATCH instead.
    staging = sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+) v0\.0\.0\s*$", upstream, re.M)))
    staged_version = "v0" + KUBERNETES[2:]
    major, minor = KUBERNETES[1:].split(".")[:2]
    gomod = "module dispatch-admission/e2e-kube\n\ngo 1.26\n\n"
    gomod += f"require k8s.io/kubernetes {KUBERNETES}\n\n"
    gomod += "tool (\n" + "".join(f"\t{pkg}\n" for pkg in KUBE_COMMANDS) + ")\n\n"
    gomod += "replace (\n" + "".join(f"\t{m} => {m} {staged_version}\n" for m in staging) + ")\n"
    version_vars = [
        f"gitVersion={KUBERNETES}",
        f"gitMajor={major}",
        f"gitMinor={minor}",
        "gitTreeState=clean",
        "buildDate=1970-01-01T00:00:00Z",
    ]
    ldflags = " ".join(
        f"-X {pkg}.{var}"
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for var in version_vars
    )
    return _build(
        f"kubernetes-{KUBERNETES}",
        gomod,
        KUBE_COMMANDS,
        ldflags="-s -w " + ldflags,
    )


def etcd_bin() -> Path:
    """etcd from its server module; its go.mod has replace lines, so `go install pkg@v` refuses it."""
    main = ('package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
            'func main() { etcdmain.Main(os.Args) }\n')
    gomod = f"module dispatch-admission/e2e-etcd\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 {ETCD}\n"
    return _build(f"etcd-{ETCD}", gomod, ["."], ldflags="-s -w", extra_files={"main.go": main},
                  renames={"e2e-etcd": "etcd"})


def helm_bin() -> Path:
    gomod = (f"module dispatch-admission/e2e-helm\n\ngo 1.26\n\nrequire helm.sh/helm/v3 {HELM}\n\n"
             "tool helm.sh/helm/v3/cmd/helm\n")
    # Helm's default Kubernetes version (for `helm template` and `lint`) is stamped at build time, from
    # the client-go it is built with, as its own Makefile does.
    helm_mod = (module_dir("helm.sh/helm/v3", HELM) / "go.mod").read_text()
    k8s_minor = re.search(r"k8s\.io/client-go v0\.(\d+)\.", helm_mod).group(1)
    ldflags = f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM}" + "".join(
        f" -X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMinor={k8s_minor}"
        for pkg in ("chartutil", "lint/rules"))
    return _build(f"helm-{HELM}", gomod, ["helm.sh/helm/v3/cmd/helm"], ldflags=ldflags)


PROMETHEUS = "v0.316.0"  # Prometheus 3.16.0: the Go module tags v3 releases as v0.3MM.P


def promtool_bin() -> Path:
    """promtool (check rules, test rules) from github.com/prometheus/prometheus, for the chart's alerts."""
    pkg = "github.com/prometheus/prometheus/cmd/promtool"
    gomod = (f"module dispatch-admission/e2e-promtool\n\ngo 1.26\n\n"
             f"require github.com/prometheus/prometheus {PROMETHEUS}\n\ntool {pkg}\n")
    minor, patch = PROMETHEUS[len("v0.3"):].split(".")
    ldflags = f"-s -w -X github.com/prometheus/common/version.Version=3.{int(minor)}.{patch}"
    # remove_all_sd: no service-discovery plugins (cloud SDKs, client-go), which rule checks never use.
    return _build(f"promtool-{PROMETHEUS}", gomod, [pkg], ldflags=ldflags, tags="remove_all_sd")


HELM_DOCS = "v1.14.2"


def helm_docs_bin() -> Path:
    """helm-docs from github.com/norwoodj/helm-docs: the chart's README.md from values.yaml (tools/gen_docs.py)."""
    pkg = "github.com/norwoodj/helm-docs/cmd/helm-docs"
    gomod = (f"module dispatch-admission/e2e-helm-docs\n\ngo 1.26\n\n"
             f"require github.com/norwoodj/helm-docs {HELM_DOCS}\n\ntool {pkg}\n")
    return _build(f"helm-docs-{HELM_DOCS}", gomod, [pkg], ldflags=f"-s -w -X main.version={HELM_DOCS}")


def trainer_bin() -> Path:
    """Trainer's controller manager (its controllers and webhooks), run out of cluster by the e2e suite."""
    pkg = "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager"
    gomod = (f"module dispatch-admission/e2e-trainer\n\ngo 1.26\n\nrequire github.com/kubeflow/trainer/v2 {TRAINER}\n\n"
             f"tool {pkg}\n")
    return _build(f"trainer-{TRAINER}", gomod, [pkg], ldflags="-s -w")


def kueue_bin() -> Path:
    """Kueue's manager (its controllers and webhooks), run out of cluster beside Trainer's on the node."""
    pkg = "sigs.k8s.io/kueue/cmd/kueue"
    gomod = (f"module dispatch-admission/e2e-kueue\n\ngo 1.26\n\nrequire sigs.k8s.io/kueue {KUEUE}\n\n"
             f"tool {pkg}\n")
    # `go get sigs.k8s.io/kueue@V` leaves go.sum without some of the manager's packages; the command's does not.
    return _build(f"kueue-{KUEUE}", gomod, [pkg], ldflags=f"-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion={KUEUE}",
                  get=[f"{pkg}@{KUEUE}"])


def kueue_module() -> Path:
    """Kueue's module: its CRDs, RBAC and webhook manifests are under config/components."""
    return module_dir("sigs.k8s.io/kueue", KUEUE)


def kueue_crds() -> list[Path]:
    return sorted((kueue_module() / "config" / "components" / "crd" / "bases").glob("*.yaml"))


def buildkit_bin() -> Path:
    """buildkitd and buildctl from github.com/moby/buildkit (CGO off): the image builder behind `docker build`."""
    pkgs = [f"github.com/moby/buildkit/cmd/{cmd}" for cmd in ("buildkitd", "buildctl")]
    gomod = (f"module dispatch-admission/e2e-buildkit\n\ngo 1.26\n\nrequire github.com/moby/buildkit {BUILDKIT}\n\n"
             "tool (\n" + "".join(f"\t{pkg}\n" for pkg in pkgs) + ")\n")
    ldflags = f"-s -w -X github.com/moby/buildkit/version.Version={BUILDKIT}"
    return _build(f"buildkit-{BUILDKIT}", gomod, pkgs, ldflags=ldflags)


def syft_bin() -> Path:
    """syft from github.com/anchore/syft (CGO off, its release's build tags): the image's SBOM (issue 25)."""
    pkg = "github.com/anchore/syft/cmd/syft"
    gomod = (f"module dispatch-admission/e2e-syft\n\ngo 1.26\n\nrequire github.com/anchore/syft {SYFT}\n\n"
             f"tool {pkg}\n")
    ldflags = f"-s -w -X main.version={SYFT}"
    return _build(f"syft-{SYFT}", gomod, [pkg], ldflags=ldflags,
                  tags="containers_image_openpgp exclude_graphdriver_btrfs")



def cosign_bin() -> Path:
    """cosign from github.com/sigstore/cosign/v3 (CGO off, as its release's `make cosign`): signs the image,
    attaches its SBOM as an attestation and verifies both with a key the test makes (issue 37)."""
    pkg = "github.com/sigstore/cosign/v3/cmd/cosign"
    gomod = (f"module dispatch-admission/e2e-cosign\n\ngo 1.26\n\nrequire github.com/sigstore/cosign/v3 {COSIGN}\n\n"
             f"tool {pkg}\n")
    ldflags = (f"-s -w -X sigs.k8s.io/release-utils/version.gitVersion={COSIGN}"
               " -X sigs.k8s.io/release-utils/version.gitTreeState=clean")
    return _build(f"cosign-{COSIGN}", gomod, [pkg], ldflags=ldflags)

# ---- the node (issue 11): container runtime, CNI, registry tooling, JobSet's controller ----

CONTAINERD = "v2.4.2"
RUNC = "v1.4.4"
CNI_PLUGINS = "v1.10.0"
CRANE = "v0.22.1"
CRICTL = "v1.37.0"
NODE_APT = ("libseccomp-dev", "busybox-static", "iptables")


def apt_install(packages: tuple[str, ...]) -> list[str]:
    """Debian packages installed once, those missing only (apt-get, as root)."""
    missing = [p for p in packages
               if subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True)
               .stdout.strip() != "install ok installed"]
    if missing:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True,
                       capture_output=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return list(packages)


def node_apt() -> list[str]:
    """Debian packages the node needs: libseccomp (runc's seccomp, built with cgo), busybox-static (the
    training image's shell), iptables (the kubelet's and kube-proxy's rules). Installed once if missing."""
    return apt_install(NODE_APT)


def containerd_bin() -> Path:
    """containerd, ctr and containerd-shim-runc-v2 (CGO off, no btrfs/zfs/devmapper/aufs snapshotters)."""
    pkgs = [f"github.com/containerd/containerd/v2/cmd/{cmd}" for cmd in ("containerd", "ctr",
                                                                         "containerd-shim-runc-v2")]
    gomod = (f"module dispatch-admission/e2e-containerd\n\ngo 1.26\n\n"
             f"require github.com/containerd/containerd/v2 {CONTAINERD}\n\n"
             "tool (\n" + "".join(f"\t{pkg}\n" for pkg in pkgs) + ")\n")
    ldflags = ("-s -w -X github.com/containerd/containerd/v2/version.Version=" + CONTAINERD +
               " -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2")
    return _build(f"containerd-{CONTAINERD}", gomod, pkgs, ldflags=ldflags,
                  tags="no_btrfs no_zfs no_devmapper no_aufs urfave_cli_no_docs")


def runc_bin() -> Path:
    """runc from its module, with cgo and libseccomp (Debian's libseccomp-dev), as its Makefile builds it."""
    node_apt()
    gomod = (f"module dispatch-admission/e2e-runc\n\ngo 1.26\n\nrequire github.com/opencontainers/runc {RUNC}\n\n"
             "tool github.com/opencontainers/runc\n")
    return _build(f"runc-{RUNC}", gomod, ["github.com/opencontainers/runc"], ldflags="-s -w",
                  tags="seccomp urfave_cli_no_docs", env={"CGO_ENABLED": "1"})


def cni_bin() -> Path:
    """The CNI plugins the node's pod network uses: bridge, host-local and loopback."""
    base = "github.com/containernetworking/plugins/plugins"
    pkgs = [f"{base}/main/bridge", f"{base}/ipam/host-local", f"{base}/main/loopback"]
    gomod = (f"module dispatch-admission/e2e-cni\n\ngo 1.26\n\n"
             f"require github.com/containernetworking/plugins {CNI_PLUGINS}\n\n"
             "tool (\n" + "".join(f"\t{pkg}\n" for pkg in pkgs) + ")\n")
    return _build(f"cni-{CNI_PLUGINS}", gomod, pkgs, ldflags="-s -w")


def crane_bin() -> Path:
    """crane: a registry on loopback (`crane registry serve`) and image assembly from layer tarballs."""
    pkg = "github.com/google/go-containerregistry/cmd/crane"
    gomod = (f"module dispatch-admission/e2e-crane\n\ngo 1.26\n\n"
             f"require github.com/google/go-containerregistry {CRANE}\n\ntool {pkg}\n")
    return _build(f"crane-{CRANE}", gomod, [pkg], ldflags="-s -w")


def crictl_bin() -> Path:
    """crictl, to stop and remove pod sandboxes when the node is torn down."""
    pkg = "sigs.k8s.io/cri-tools/cmd/crictl"
    gomod = (f"module dispatch-admission/e2e-crictl\n\ngo 1.26\n\nrequire sigs.k8s.io/cri-tools {CRICTL}\n\n"
             f"tool {pkg}\n")
    return _build(f"crictl-{CRICTL}", gomod, [pkg],
                  ldflags=f"-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version={CRICTL}")


def jobset_bin() -> Path:
    """JobSet's controller manager (its controllers and webhooks), run out of cluster like Trainer's."""
    gomod = (f"module dispatch-admission/e2e-jobset\n\ngo 1.26\n\nrequire sigs.k8s.io/jobset {JOBSET}\n\n"
             "tool sigs.k8s.io/jobset\n")
    return _build(f"jobset-{JOBSET}", gomod, ["sigs.k8s.io/jobset"], ldflags="-s -w",
                  renames={"jobset": "jobset-controller-manager"})


def stub_bin(name: str) -> Path:
    """A static stand-in the node's images carry, from tests/stubs/NAME/main.go: `publish` (go/dispatch's
    binary cannot be fetched: it prints its own path and arguments and exits 0) or `pause` (the pod
    sandbox: sleeps until SIGTERM)."""
    main = (Path(__file__).resolve().parent.parent / "stubs" / name / "main.go").read_text()
    gomod = f"module dispatch-admission/e2e-stub-{name}\n\ngo 1.26\n"
    bindir = _build(f"stub-{name}", gomod, ["."], ldflags="-s -w", extra_files={"main.go": main},
                    renames={f"e2e-stub-{name}": name})
    return bindir / name


def node_bins() -> dict[str, Path]:
    """Every binary the one-node cluster runs, by name."""
    kube, ctrd = kube_bin(), containerd_bin()
    bins = {n: kube / n for n in ("kubelet", "kube-scheduler", "kube-controller-manager", "kube-proxy")}
    bins.update({n: ctrd / n for n in ("containerd", "ctr", "containerd-shim-runc-v2")})
    bins.update({"runc": runc_bin() / "runc", "crane": crane_bin() / "crane", "crictl": crictl_bin() / "crictl",
                 "jobset-controller-manager": jobset_bin() / "jobset-controller-manager",
                 "publish": stub_bin("publish"), "pause": stub_bin("pause"), "cni": cni_bin()})
    return bins


KYVERNO = "v1.15.2"


def kyverno_bin() -> Path:
    """Kyverno's admission controller (cmd/kyverno), run out of cluster by the Kyverno comparison (issue 27).

    Its go.mod replaces one module and its go.sum holds a hash the checksum database lacks
    (github.com/openreports/reports-api), so the wrapper carries both from Kyverno's own module."""
    mod = module_dir("github.com/kyverno/kyverno", KYVERNO)
    upstream = (mod / "go.mod").read_text()
    replaces = re.findall(r"^replace (.+)$", upstream, re.M)
    pkg = "github.com/kyverno/kyverno/cmd/kyverno"
    gomod = (f"module dispatch-admission/e2e-kyverno\n\ngo 1.26\n\nrequire github.com/kyverno/kyverno {KYVERNO}\n\n"
             f"tool {pkg}\n\n" + "".join(f"replace {r}\n" for r in replaces))
    ldflags = f"-s -w -X github.com/kyverno/kyverno/pkg/version.BuildVersion={KYVERNO}"
    return _build(f"kyverno-{KYVERNO}", gomod, [pkg], ldflags=ldflags,
                  extra_files={"go.sum": (mod / "go.sum").read_text()})


def kyverno_crds() -> list[Path]:
    """The CRDs Kyverno's admission controller lists and watches (its policies, reports and exceptions)."""
    crds = module_dir("github.com/kyverno/kyverno", KYVERNO) / "config" / "crds"
    dirs = ("kyverno", "policies.kyverno.io", "policyreport", "reports")
    return sorted(p for d in dirs for p in (crds / d).glob("*.yaml"))


def jobset_crds() -> list[Path]:
    crds = module_dir("sigs.k8s.io/jobset", JOBSET) / "config" / "components" / "crd" / "bases"
    return sorted(crds.glob("*.yaml"))


def trainer_crds() -> list[Path]:
    crds = module_dir("github.com/kubeflow/trainer/v2", TRAINER) / "manifests" / "base" / "crds"
    return sorted(crds.glob("trainer.kubeflow.org_*.yaml"))


def openreports_crds() -> list[Path]:
    """OpenReports' CRDs (openreports.io/v1alpha1 Report and ClusterReport), from their Go module."""
    crds = module_dir("github.com/openreports/reports-api", OPENREPORTS) / "config" / "crd"
    return sorted(crds.glob("openreports.io_*.yaml"))


def trainer_module() -> Path:
    return module_dir("github.com/kubeflow/trainer/v2", TRAINER)


def kubernetes_bins() -> dict[str, Path]:
    return {
        "kube-apiserver": kube_bin() / "kube-apiserver",
        "kubectl": kube_bin() / "kubectl",
        "etcd": etcd_bin() / "etcd",
    }


def main(argv: list[str]) -> int:
    if "--fetch-only" in argv:
        _FETCH_ONLY.set()
        argv = [a for a in argv if a != "--fetch-only"]
    wanted = argv or ["etcd", "kube", "helm", "trainer", "crds", "jobset", "buildkit", "node", "promtool", "helm-docs",
                      "kueue", "syft", "openreports"]  # kyverno and cosign: `make toolchain-extra`
    builders = {"etcd": etcd_bin, "kube": kube_bin, "helm": helm_bin, "trainer": trainer_bin, "crds": trainer_crds,
                "helm-docs": helm_docs_bin,
                "jobset": jobset_crds, "buildkit": buildkit_bin, "promtool": promtool_bin,
                "node": node_bins, "kyverno": kyverno_bin, "kueue": kueue_bin, "syft": syft_bin,
                "openreports": openreports_crds, "cosign": cosign_bin}
    # The node's binaries as tasks of their own, so they fetch and compile beside the rest ("node" then finds
    # them built, or waits on their locks). The longest build (Kubernetes) first.
    node_parts = {"node containerd": containerd_bin, "node runc": runc_bin, "node crane": crane_bin,
                  "node crictl": crictl_bin, "node jobset": jobset_bin, "node cni": cni_bin,
                  "node publish": lambda: stub_bin("publish"), "node pause": lambda: stub_bin("pause")}
    first = {"kube": kube_bin} if "kube" in wanted or "node" in wanted else {}
    tasks = {**first, **(node_parts if "node" in wanted else {}), **{name: builders[name] for name in wanted}}
    started = time.monotonic()

    def timed(build):
        began = time.monotonic()
        return build(), time.monotonic() - began

    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(tasks)) as pool:
        running = {pool.submit(timed, build): name for name, build in tasks.items()}
        for done in concurrent.futures.as_completed(running):
            name = running[done]
            try:
                result, seconds = done.result()
            except Exception as e:  # the others go on: one run reports every failure
                failed.append(name)
                print(f"{name}: FAILED\n{e}", flush=True)
                continue
            if name in wanted:
                print(f"{name}: {result} ({seconds:.0f}s)", flush=True)
    print(f"toolchain: {'failed: ' + ', '.join(failed) if failed else 'ready'} ({time.monotonic() - started:.0f}s)",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
