"""Build and cache the end-to-end binaries from pinned Go modules.

No Docker, kind or prebuilt Kubernetes binaries can be had here, only the Go module proxy, so
kube-apiserver, kubectl, etcd and helm are built from source once and cached per pinned version
in a user-level directory (a fresh clone reuses them). Trainer's CRDs come from its Go module.

Run `python -m tests.e2e.toolchain` to build everything ahead of the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

KUBERNETES = "v1.37.2"
ETCD = "v3.6.16"
HELM = "v3.22.0"
TRAINER = "v2.3.0"
JOBSET = "v0.12.0"


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
    info = json.loads(_go(["mod", "download", "-json", f"{path}@{version}"], scratch))
    return Path(info["Dir"])


def _build(name: str, gomod: str, packages: list[str], ldflags: str = "", extra_files: dict | None = None) -> Path:
    """Build `packages` in a throw-away module described by `gomod`; return the bin directory.

    The cache directory is keyed by the pinned version and a hash of the whole recipe, so changing
    any of it rebuilds (quickly: Go's build cache keeps the compiled packages).
    """
    recipe = json.dumps([gomod, packages, ldflags, extra_files], sort_keys=True).encode()
    name = f"{name}-{hashlib.sha256(recipe).hexdigest()[:8]}"
    bindir = cache_root() / name / "bin"
    stamp = bindir / ".complete"
    if stamp.exists():
        return bindir
    work = cache_root() / name / "src"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "go.mod").write_text(gomod)
    for fname, text in (extra_files or {}).items():
        (work / fname).write_text(text)
    started = time.monotonic()
    _go(["mod", "tidy"], work)
    bindir.mkdir(parents=True, exist_ok=True)
    args = ["build", "-trimpath", "-o", str(bindir) + "/"]
    if ldflags:
        args += ["-ldflags", ldflags]
    _go(args + packages, work)
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
    main = 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n'
    gomod = f"module dispatch-admission/e2e-etcd\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 {ETCD}\n"
    bindir = _build(f"etcd-{ETCD}", gomod, ["."], ldflags="-s -w", extra_files={"main.go": main})
    built = bindir / "e2e-etcd"
    if built.exists():
        built.rename(bindir / "etcd")
    return bindir


def helm_bin() -> Path:
    gomod = f"module dispatch-admission/e2e-helm\n\ngo 1.26\n\nrequire helm.sh/helm/v3 {HELM}\n\ntool helm.sh/helm/v3/cmd/helm\n"
    # Helm's default Kubernetes version (for `helm template` and `lint`) is stamped at build time, from
    # the client-go it is built with, as its own Makefile does.
    helm_mod = (module_dir("helm.sh/helm/v3", HELM) / "go.mod").read_text()
    k8s_minor = re.search(r"k8s\.io/client-go v0\.(\d+)\.", helm_mod).group(1)
    ldflags = f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM}" + "".join(
        f" -X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMinor={k8s_minor}"
        for pkg in ("chartutil", "lint/rules"))
    return _build(f"helm-{HELM}", gomod, ["helm.sh/helm/v3/cmd/helm"], ldflags=ldflags)


def trainer_bin() -> Path:
    """Trainer's controller manager (its controllers and webhooks), run out of cluster by the e2e suite."""
    pkg = "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager"
    gomod = (f"module dispatch-admission/e2e-trainer\n\ngo 1.26\n\nrequire github.com/kubeflow/trainer/v2 {TRAINER}\n\n"
             f"tool {pkg}\n")
    return _build(f"trainer-{TRAINER}", gomod, [pkg], ldflags="-s -w")


def jobset_crds() -> list[Path]:
    crds = module_dir("sigs.k8s.io/jobset", JOBSET) / "config" / "components" / "crd" / "bases"
    return sorted(crds.glob("*.yaml"))


def trainer_crds() -> list[Path]:
    crds = module_dir("github.com/kubeflow/trainer/v2", TRAINER) / "manifests" / "base" / "crds"
    return sorted(crds.glob("trainer.kubeflow.org_*.yaml"))


def trainer_module() -> Path:
    return module_dir("github.com/kubeflow/trainer/v2", TRAINER)


def kubernetes_bins() -> dict[str, Path]:
    return {
        "kube-apiserver": kube_bin() / "kube-apiserver",
        "kubectl": kube_bin() / "kubectl",
        "etcd": etcd_bin() / "etcd",
    }


def main(argv: list[str]) -> int:
    wanted = argv or ["etcd", "kube", "helm", "trainer", "crds", "jobset"]
    builders = {"etcd": etcd_bin, "kube": kube_bin, "helm": helm_bin, "trainer": trainer_bin, "crds": trainer_crds,
                "jobset": jobset_crds}
    for name in wanted:
        started = time.monotonic()
        result = builders[name]()
        print(f"{name}: {result} ({time.monotonic() - started:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
