"""The webhook's image, built from the project's Dockerfile by BuildKit, here, as a user's `docker build` would.

No Docker engine runs here and public base images cannot be pulled, so:
- BuildKit (buildkitd + buildctl, built from github.com/moby/buildkit by the toolchain) runs with only its OCI
  worker on runc (the node's runc v1.4 from its module), the overlayfs snapshotter and the host network for
  RUN steps; its root, runc state, sockets and cgroups live under a temporary directory or a cgroup name of
  ours, and are removed when it stops.
- The base is made from Debian's packages: `mmdebstrap --variant=minbase` bookworm with python3 and
  python3-venv, through this machine's own apt sources and settings. Its root file system is cached under
  ~/.cache/dispatch-admission/e2e/ by a hash of its recipe, imported as a one-layer OCI image into the local
  registry and passed to the Dockerfile as PYTHON_BASE, by digest.
- pip inside the build reaches the package index through this machine's TLS-intercepting proxy: the host's
  CA bundle is passed as the optional `pipcert` build secret (index settings, if the host has any, as the
  `pipconf` secret), as a user behind such a proxy would.

`build_webhook_image(registry)` builds once per test session and returns `HOST/dispatch-admission@sha256:...`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e import toolchain
from tests.e2e.registry import Registry
from tests.process import ROOT, free_port, stop

REPO = "dispatch-admission"
BASE_REPO = "dispatch-e2e/python-base"
# The test base: what the official python:3.11-slim-bookworm holds that the webhook needs.
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "netbase")
# As Debian's slim images do: no documentation but the copyright files, no man pages, no translations.
BASE_DPKG_OPTS = ("path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
                  "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
                  "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias")
BASE_EPOCH = 1700000000  # SOURCE_DATE_EPOCH for mmdebstrap: a reproducible tarball
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}

# Figures of this session's builds, for the report: seconds, and sizes in bytes.
TIMINGS: dict[str, float] = {}


def _run(cmd: list[str], timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if got.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({got.returncode}):\n{got.stdout[-3000:]}\n{got.stderr[-6000:]}")
    return got


# ---- the base image, from Debian's packages ----

def _mmdebstrap() -> str:
    found = shutil.which("mmdebstrap")
    if found:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "mmdebstrap"]
    if subprocess.run(install, capture_output=True, env=env).returncode != 0:
        _run(["apt-get", "update", "-qq"])
        _run(install, env=env)
    return shutil.which("mmdebstrap")


def host_apt_sources() -> list[Path]:
    """The host's Debian sources (the mirror apt reaches here), or none: then mmdebstrap's default mirror."""
    candidates = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]
    return [p for p in candidates if p.exists()
            and any(line.strip() and not line.lstrip().startswith("#") for line in p.read_text().splitlines())]


def host_apt_options() -> list[Path]:
    """The host's apt settings about reaching the archive (proxy, Check-Valid-Until, ...), passed on."""
    confd = Path("/etc/apt/apt.conf.d")
    files = sorted(confd.glob("*")) if confd.is_dir() else []
    return [p for p in files if p.is_file()
            and re.search(r"^\s*Acquire(::|\s*\{)", p.read_text(errors="replace"), re.M)]


def base_recipe() -> dict:
    version = _run([_mmdebstrap(), "--version"]).stdout.strip()
    return {
        "mmdebstrap": version, "suite": BASE_SUITE, "packages": list(BASE_PACKAGES), "variant": "minbase",
        "dpkgopts": list(BASE_DPKG_OPTS), "epoch": BASE_EPOCH,
        "sources": {str(p): p.read_text() for p in host_apt_sources()},
        "aptopts": {str(p): p.read_text() for p in host_apt_options()},
    }


def base_rootfs() -> Path:
    """bookworm minbase with python3 and python3-venv as a tarball, cached by a hash of its recipe."""
    recipe = base_recipe()
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    out = toolchain.cache_root() / f"python-base-{BASE_SUITE}-{key}"
    tar = out / "rootfs.tar"
    if (out / ".complete").exists():
        return tar
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.monotonic()
    cmd = [_mmdebstrap(), "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES)]
    cmd += [f"--dpkgopt={o}" for o in BASE_DPKG_OPTS]
    cmd += [f"--aptopt={p}" for p in host_apt_options()]
    cmd += [BASE_SUITE, str(tar)] + [str(p) for p in host_apt_sources()]
    _run(cmd, env={**os.environ, "SOURCE_DATE_EPOCH": str(BASE_EPOCH)})
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2, sort_keys=True))
    elapsed = time.monotonic() - started
    (out / ".complete").write_text(f"built in {elapsed:.0f}s\n")
    TIMINGS["base rootfs (mmdebstrap)"] = elapsed
    return tar


_BASES: dict[str, str] = {}


def push_base(registry: Registry) -> str:
    """The Debian base as a one-layer OCI image (platform linux/amd64, PATH set) in `registry`, by digest."""
    if registry.host not in _BASES:
        rootfs = base_rootfs()
        started = time.monotonic()
        _BASES[registry.host] = registry.push_layers(BASE_REPO, [rootfs], env=BASE_ENV, cmd=["python3"],
                                                     tag=f"{BASE_SUITE}-python3")
        TIMINGS["base import (crane append + mutate)"] = time.monotonic() - started
    return _BASES[registry.host]


# ---- BuildKit ----

def runc() -> Path:
    """runc for BuildKit's worker and the image checks: the node's v1.4 from its module."""
    return toolchain.runc_bin() / "runc"


def _cgroup_cleanup(name: str) -> None:
    """Remove the cgroup `name` (and what BuildKit made below it) from every hierarchy, deepest first."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def _unmount_under(path: Path) -> None:
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(str(path) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


@dataclass
class BuildKit:
    """A running buildkitd; `build()` drives it with buildctl."""
    dir: Path
    addr: str
    proc: subprocess.Popen
    log: Path
    cgroup: str
    bins: Path = field(default_factory=toolchain.buildkit_bin)

    def buildctl(self, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
        return _run([str(self.bins / "buildctl"), "--addr", self.addr, *args], timeout=timeout)

    def build(self, context: Path, out: Path, build_args: dict[str, str], secrets: dict[str, Path],
              no_cache: bool = False, rewrite_timestamp: bool = True) -> dict:
        """Build `context`'s Dockerfile with the built-in dockerfile.v0 frontend into the OCI layout
        directory `out`; returns buildctl's metadata (containerimage.digest among it)."""
        meta = out.parent / f"{out.name}.metadata.json"
        args = ["build", "--frontend", "dockerfile.v0", "--local", f"context={context}",
                "--local", f"dockerfile={context}", "--progress", "plain", "--metadata-file", str(meta)]
        for key, value in build_args.items():
            args += ["--opt", f"build-arg:{key}={value}"]
        for sid, src in secrets.items():
            args += ["--secret", f"id={sid},src={src}"]
        if no_cache:
            args += ["--no-cache"]
        output = f"type=oci,tar=false,dest={out}"
        if rewrite_timestamp:
            output += ",rewrite-timestamp=true"
        args += ["--output", output]
        got = self.buildctl(*args)
        (out.parent / f"{out.name}.build.log").write_text(got.stderr)
        return json.loads(meta.read_text())


@contextlib.contextmanager
def buildkitd(insecure_registries: list[str]):
    """buildkitd with only its OCI worker on runc; everything it writes is removed when the block ends."""
    bins = toolchain.buildkit_bin()
    work = Path(tempfile.mkdtemp(prefix="bk-", dir="/tmp"))  # short: unix socket paths are limited
    cgroup = f"dispatch-admission-e2e-buildkit-{uuid.uuid4().hex[:8]}"
    # runc's state where we choose (its default is /run/runc): buildkitd calls the wrapper as its runc.
    wrapper = work / "runc"
    wrapper.write_text(f'#!/bin/sh\nexec {runc()} --root {work / "runc-state"} "$@"\n')
    wrapper.chmod(0o755)
    config = work / "buildkitd.toml"
    lines = [f'root = "{work / "root"}"', "[grpc]", f'  address = ["unix://{work / "buildkitd.sock"}"]',
             "[otel]", f'  socketPath = "{work / "otel-grpc.sock"}"',
             "[worker.oci]", "  enabled = true", '  snapshotter = "overlayfs"', f'  binary = "{wrapper}"',
             f'  defaultCgroupParent = "{cgroup}"', "  gc = false",
             "[worker.containerd]", "  enabled = false"]
    for host in insecure_registries:
        lines += [f'[registry."{host}"]', "  http = true", "  insecure = true"]
    config.write_text("\n".join(lines) + "\n")
    log = work / "buildkitd.log"
    addr = f"unix://{work / 'buildkitd.sock'}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(bins / "buildkitd"), "--config", str(config), "--oci-worker-net", "host"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    kit = BuildKit(work, addr, proc, log, cgroup, bins)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"buildkitd exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            ready = subprocess.run([str(bins / "buildctl"), "--addr", addr, "debug", "workers"],
                                   capture_output=True, text=True, timeout=30)
            if ready.returncode == 0 and len(ready.stdout.splitlines()) > 1:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"buildkitd not ready:\n{ready.stderr}\n{log.read_text()[-4000:]}")
            time.sleep(0.3)
        yield kit
    finally:
        stop(proc, timeout=30)
        _unmount_under(work)
        _cgroup_cleanup(cgroup)
        shutil.rmtree(work, ignore_errors=True)


def proxy_secrets(tmp: Path) -> dict[str, Path]:
    """The host's CA bundle (it holds the egress proxy's CA) as `pipcert`, and the host's index settings,
    if any, as a `pipconf` pip.conf (never the host's pip.conf itself: its `cert` path is a host path)."""
    secrets = {}
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            secrets["pipcert"] = Path(candidate)
            break
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    index = {}
    for line in listed.splitlines():
        m = re.fullmatch(r"[^.]*\.(index-url|extra-index-url|trusted-host)='(.*)'", line.strip())
        if m:
            index[m.group(1)] = m.group(2)
    if index:
        conf = tmp / "pip.conf"
        conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(index.items())))
        conf.chmod(0o600)
        secrets["pipconf"] = conf
    return secrets


def source_date_epoch() -> int:
    """The commit's time, as reproducible builds take it (0 outside a git checkout)."""
    got = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    return int(got.stdout.strip()) if got.returncode == 0 and got.stdout.strip() else 0


@dataclass(frozen=True)
class Context:
    """A copy of the build context (what .dockerignore admits, plus the Dockerfile) and its
    SOURCE_DATE_EPOCH, taken once: every build of a session builds the same bytes, whatever else is
    edited or committed in the working tree meanwhile."""
    dir: Path
    epoch: int


def snapshot_context(dest: Path) -> Context:
    admitted = [line.strip()[1:] for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip().startswith("!")]
    epoch = source_date_epoch()
    for rel in ["Dockerfile", ".dockerignore", *admitted]:
        src, dst = ROOT / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst)
    return Context(dest, epoch)


def build_layout(registry: Registry, context: Context, out: Path, *, no_cache: bool = False,
                 rewrite_timestamp: bool = True, kit: BuildKit | None = None,
                 secrets: dict[str, Path] | None = None) -> Path:
    """The Dockerfile of `context` built on the Debian base (pushed to `registry`) into the OCI layout `out`,
    by a buildkitd of its own unless `kit` is given; `secrets` default to the host's (proxy_secrets)."""
    base = push_base(registry)
    out.parent.mkdir(parents=True, exist_ok=True)
    build_args = {"PYTHON_BASE": base, "SOURCE_DATE_EPOCH": str(context.epoch)}
    with contextlib.ExitStack() as stack:
        if kit is None:
            started = time.monotonic()
            kit = stack.enter_context(buildkitd([registry.host]))
            TIMINGS["buildkitd start"] = time.monotonic() - started
        started = time.monotonic()
        kit.build(context.dir, out, build_args, proxy_secrets(out.parent) if secrets is None else secrets,
                  no_cache=no_cache,
                  rewrite_timestamp=rewrite_timestamp)
        TIMINGS[f"image build ({out.name})"] = time.monotonic() - started
    return out


def layout_digest(layout: Path) -> str:
    """The manifest digest of the one image in an OCI layout directory."""
    return json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]


@dataclass
class _Session:
    work: Path
    context: Context
    layout: Path | None = None
    pushed: dict[str, str] = field(default_factory=dict)


_SESSION: list[_Session] = []


def _session() -> _Session:
    if not _SESSION:
        work = Path(tempfile.mkdtemp(prefix="dispatch-admission-image-"))
        atexit.register(shutil.rmtree, work, ignore_errors=True)
        _SESSION.append(_Session(work, snapshot_context(work / "context")))
    return _SESSION[0]


def build_webhook_image(registry: Registry) -> str:
    """The webhook image, built once per session, pushed to `registry`: `HOST/dispatch-admission@sha256:...`."""
    session = _session()
    if registry.host not in session.pushed:
        if session.layout is None:
            session.layout = build_layout(registry, session.context, session.work / "layout")
        session.pushed[registry.host] = registry.push_oci_layout(REPO, session.layout)
    return session.pushed[registry.host]


def lock_wheels() -> Path:
    """Every wheel requirements/image.lock pins, for this machine's Python (3.11, glibc, x86_64, as the
    base's), downloaded with hashes checked; cached by the lock's hash."""
    lock = ROOT / "requirements" / "image.lock"
    out = toolchain.cache_root() / f"wheels-{hashlib.sha256(lock.read_bytes()).hexdigest()[:12]}"
    if not (out / ".complete").exists():
        shutil.rmtree(out, ignore_errors=True)
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
              "--only-binary=:all:", "-r", str(lock), "-d", str(out)])
        (out / ".complete").write_text("")
    return out


@contextlib.contextmanager
def local_index(wheels: Path):
    """The wheels served on loopback as a pip find-links page (http.server's directory listing)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                             "--directory", str(wheels)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the local package index did not start") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/"
    finally:
        stop(proc)


def rebuild_from_scratch(registry: Registry) -> Path:
    """The session's context built again as a user elsewhere would: a new buildkitd with no cache, no CA
    secret, and the index given only as the `pipconf` secret (a pip.conf pointing at the lock's wheels on
    a loopback index). Same base and SOURCE_DATE_EPOCH: a reproducible build gives the first digest."""
    session = _session()
    build_webhook_image(registry)
    out = session.work / "rebuild"
    if not out.exists():
        with local_index(lock_wheels()) as url:
            conf = session.work / "rebuild-pip.conf"
            conf.write_text(f"[global]\nno-index = true\nfind-links = {url}\n")
            build_layout(registry, session.context, out, no_cache=True, secrets={"pipconf": conf})
    return out


# ---- looking into a built image ----

def layer_sizes(registry: Registry, ref: str) -> list[tuple[str, int, int]]:
    """(digest, compressed bytes, uncompressed bytes) of each layer of `ref`, bottom first."""
    sizes = []
    for layer in registry.manifest(ref)["layers"]:
        blob = subprocess.Popen([registry.crane, "blob", f"{ref.split('@')[0]}@{layer['digest']}", "--insecure"],
                                stdout=subprocess.PIPE)
        if "gzip" in layer["mediaType"]:
            inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
            total = 0
            while chunk := blob.stdout.read(1 << 20):
                total += len(inflate.decompress(chunk))
            total += len(inflate.flush())
        else:
            total = sum(len(c) for c in iter(lambda: blob.stdout.read(1 << 20), b""))
        if blob.wait() != 0:
            raise RuntimeError(f"crane blob {layer['digest']} failed")
        sizes.append((layer["digest"], layer["size"], total))
    return sizes


def export_rootfs(registry: Registry, ref: str, dest: Path) -> Path:
    """The image's flattened file system (whiteouts applied) unpacked into `dest`, owners kept."""
    dest.mkdir(parents=True, exist_ok=True)
    export = subprocess.Popen([registry.crane, "export", ref, "-", "--insecure"], stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "--numeric-owner", "-C", str(dest)], stdin=export.stdout,
                           capture_output=True)
    export.stdout.close()
    if export.wait() != 0 or untar.returncode != 0:
        raise RuntimeError(f"crane export {ref} failed: {untar.stderr.decode()[-2000:]}")
    return dest


def run_in_image(rootfs: Path, config: dict, args: list[str], *, mounts: dict[str, Path] | None = None,
                 user: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`args` run under runc in `rootfs` as the image config says (its user, env, working dir) with a
    read-only root, no network but loopback, and files bind-mounted read-only from `mounts`."""
    cfg = config.get("config") or {}
    uid, _, gid = (user or cfg.get("User") or "0").partition(":")
    bundle = Path(tempfile.mkdtemp(prefix="dispatch-image-run-"))
    cid = f"dispatch-image-{uuid.uuid4().hex[:10]}"
    try:
        _run([str(runc()), "spec", "--bundle", str(bundle)])
        spec = json.loads((bundle / "config.json").read_text())
        spec["root"] = {"path": str(rootfs), "readonly": True}
        spec["process"].update(terminal=False, args=args, cwd=cfg.get("WorkingDir") or "/",
                               env=cfg.get("Env") or [], user={"uid": int(uid), "gid": int(gid or uid)})
        spec["hostname"] = "image-check"
        spec["linux"]["cgroupsPath"] = f"/{cid}"
        for target, source in (mounts or {}).items():
            spec["mounts"].append({"destination": target, "type": "bind", "source": str(source),
                                   "options": ["rbind", "ro", "nosuid", "nodev"]})
        (bundle / "config.json").write_text(json.dumps(spec))
        return subprocess.run([str(runc()), "--root", str(bundle / "state"), "run", "--bundle", str(bundle), cid],
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    finally:
        subprocess.run([str(runc()), "--root", str(bundle / "state"), "delete", "--force", cid], capture_output=True)
        _cgroup_cleanup(cid)
        shutil.rmtree(bundle, ignore_errors=True)


if __name__ == "__main__":
    # Build once by hand: python -m tests.e2e.image
    with tempfile.TemporaryDirectory() as tmp:
        reg = Registry.start(Path(tmp) / "registry")
        try:
            print(build_webhook_image(reg))
            for name, value in TIMINGS.items():
                print(f"{name}: {value:.0f}s")
        finally:
            reg.stop()
