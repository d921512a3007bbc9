"""The webhook's image, built from the project's Dockerfile by BuildKit, here, as a user's `docker build` would.

No Docker engine runs here and public base images cannot be pulled, so:
- BuildKit (buildkitd + buildctl, built from github.com/moby/buildkit by the toolchain) runs with only its OCI
  worker on runc (the node's runc v1.4 from its module), the overlayfs snapshotter and the host network for
  RUN steps; its root, runc state, sockets and cgroups live under a temporary directory or a cgroup name of
  ours, and are removed when it stops.
- The two bases are made from Debian 13's packages, through this machine's own apt mirror and settings: the
  build stage's with `mmdebstrap --variant=minbase` trixie and python3, python3-venv (as debian:trixie-slim
  with python3-venv installed); the final stage's distroless, with `mmdebstrap --variant=extract` of the
  interpreter, its standard library and their libraries (no shell, no coreutils, no apt or dpkg: as
  gcr.io/distroless/python3-debian13). Their root file systems are cached under
  ~/.cache/dispatch-admission/e2e/ by a hash of their recipes, imported as one-layer OCI images into the
  local registry and passed to the Dockerfile as BUILD_BASE and RUNTIME_BASE, by digest.
- pip inside the build reaches the package index through this machine's TLS-intercepting proxy: the host's
  CA bundle is passed as the optional `pipcert` build secret (index settings, if the host has any, as the
  `pipconf` secret), as a user behind such a proxy would.

The build asks for BuildKit's provenance attestation (`attest:provenance=mode=max`, as `docker buildx build
--provenance=mode=max`), so what is pushed is an image index: the linux/amd64 image and its attestation
manifest. `build_webhook_image(registry)` builds once per test session and returns that index as
`HOST/dispatch-admission@sha256:...` (containerd pulls it by digest and picks the image); `image_sbom` and
`python_sbom` give the image's SBOMs (syft, from its Go module; cyclonedx-py, from PyPI).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
import urllib.request
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name

from tests.e2e import toolchain
from tests.e2e.registry import Registry
from tests.process import ROOT, free_port, started_ready, stop

REPO = "dispatch-admission"
BUILD_BASE_REPO = "dispatch-e2e/python-build-base"
RUNTIME_BASE_REPO = "dispatch-e2e/python-runtime-base"
# Debian 13: bookworm (12) left regular security support in 2026; trixie's Python is 3.13.
BASE_SUITE = "trixie"
PYTHON = "/usr/bin/python3.13"  # Debian's interpreter, at the same path in both bases
# The build base: what debian:trixie-slim with python3-venv installed holds (minbase: apt, dpkg, a shell).
BUILD_BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "netbase")
# The runtime base, distroless-style: the packages' files extracted (`--variant=extract`: no maintainer
# script runs, so none needs a shell), no Essential set (no shell, coreutils, apt or dpkg), only the
# interpreter, its standard library and what they depend on.
RUNTIME_BASE_PACKAGES = ("base-files", "netbase", "ca-certificates", "tzdata", "python3.13-minimal",
                         "libpython3.13-stdlib")
# Pulled in only for maintainer scripts that never run here (debconf; awk for base-files'): not installed.
RUNTIME_BASE_LEFT_OUT = ("debconf", "mawk")
# As Debian's slim images do: no documentation but the copyright files, no man pages, no translations.
BASE_DPKG_OPTS = ("path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
                  "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
                  "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias")
BASE_EPOCH = 1700000000  # SOURCE_DATE_EPOCH for mmdebstrap: a reproducible tarball
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
# No command stays in the runtime base but the interpreter: openssl's, ca-certificates' and the like go (their
# packages stay for their libraries, configuration and data: OpenSSL's cert.pem link, openssl.cnf).
RUNTIME_BASE_COMMAND_DIRS = ("./usr/bin/", "./usr/sbin/", "./usr/lib/ssl/misc/")
# Nor does anything of apt's, dpkg's or mmdebstrap's, but dpkg's package records (var/lib/dpkg/status.d/).
RUNTIME_BASE_DROPPED_DIRS = ("./etc/apt/", "./etc/dpkg/", "./var/cache/apt/", "./var/cache/debconf/",
                             "./var/lib/apt/", "./var/log/apt/", "./var/lib/dpkg/")

# Figures of this session's builds, for the report: seconds, and sizes in bytes.
TIMINGS: dict[str, float] = {}


def _run(cmd: list[str], timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if got.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({got.returncode}):\n"
                           f"{got.stdout[-3000:]}\n{got.stderr[-6000:]}")
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


def suite_sources(dest: Path) -> list[Path]:
    """The host's sources (host_apt_sources) with its release's suites renamed to BASE_SUITE, written under
    `dest` (the same mirrors, bookworm-security becoming trixie-security...)."""
    release = re.search(r"^VERSION_CODENAME=(\S+)$", Path("/etc/os-release").read_text(), re.M)
    out = []
    for src in host_apt_sources():
        text = src.read_text()
        if release and release.group(1) != BASE_SUITE:
            text = re.sub(rf"(?<![\w.-]){re.escape(release.group(1))}(?=[\s-])", BASE_SUITE, text)
        dest.mkdir(parents=True, exist_ok=True)
        out.append(dest / src.name)
        out[-1].write_text(text)
    return out


def base_recipe(variant: str, packages: tuple[str, ...], arch: str = "amd64") -> dict:
    version = _run([_mmdebstrap(), "--version"]).stdout.strip()
    recipe = {
        "mmdebstrap": version, "suite": BASE_SUITE, "packages": list(packages), "variant": variant,
        "dpkgopts": list(BASE_DPKG_OPTS), "epoch": BASE_EPOCH,
        "sources": {str(p): p.read_text() for p in host_apt_sources()},
        "aptopts": {str(p): p.read_text() for p in host_apt_options()},
    }
    if arch != "amd64":  # Debian's name for the CPU (arm64); amd64's recipes keep the keys they were cached by
        recipe["architecture"] = arch
    if variant == "extract":
        # finish_runtime_base's rules; "finish" is bumped when its code changes what it writes.
        recipe.update(left_out=list(RUNTIME_BASE_LEFT_OUT), commands=list(RUNTIME_BASE_COMMAND_DIRS),
                      dropped=list(RUNTIME_BASE_DROPPED_DIRS), finish=1)
    return recipe


def _mmdebstrap_rootfs(name: str, variant: str, packages: tuple[str, ...], hooks: list[str], build,
                       arch: str = "amd64") -> Path:
    """`mmdebstrap --variant=VARIANT` of BASE_SUITE with `packages` for the CPU `arch` as a tarball, cached by a
    hash of its recipe; `build(out, tar)` turns mmdebstrap's tarball `out/mmdebstrap.tar` into `tar` (or just
    renames it). Another CPU's packages are only extracted (`--variant=extract`: nothing of theirs runs)."""
    recipe = base_recipe(variant, packages, arch)
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    if arch != "amd64":
        name = f"{name}-{arch}"
    out = toolchain.cache_root() / f"{name}-{BASE_SUITE}-{key}"
    tar = out / "rootfs.tar"
    if (out / ".complete").exists():
        return tar
    with toolchain.cache_lock(out.name):  # one maker at a time: another xdist worker waits, then finds it
        if (out / ".complete").exists():
            return tar
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        started = time.monotonic()
        cmd = [_mmdebstrap(), f"--variant={variant}", f"--architectures={arch}", "--include=" + ",".join(packages)]
        cmd += [f"--dpkgopt={o}" for o in BASE_DPKG_OPTS]
        cmd += [f"--aptopt={p}" for p in host_apt_options()]
        cmd += [h.format(out=out) for h in hooks]
        cmd += [BASE_SUITE, str(out / "mmdebstrap.tar")] + [str(p) for p in suite_sources(out / "sources")]
        _run(cmd, env={**os.environ, "SOURCE_DATE_EPOCH": str(BASE_EPOCH)})
        build(out, tar)
        (out / "recipe.json").write_text(json.dumps(recipe, indent=2, sort_keys=True))
        elapsed = time.monotonic() - started
        (out / ".complete").write_text(f"built in {elapsed:.0f}s\n")
    TIMINGS[f"{name} rootfs (mmdebstrap)"] = elapsed
    return tar


def build_base_rootfs() -> Path:
    """trixie minbase with python3 and python3-venv (a shell, apt and dpkg too): the build stage's base."""
    return _mmdebstrap_rootfs("python-build-base", "minbase", BUILD_BASE_PACKAGES, [],
                              lambda out, tar: (out / "mmdebstrap.tar").rename(tar))


def runtime_base_rootfs(arch: str = "amd64") -> Path:
    """The distroless runtime base for the CPU `arch` (Debian's name: amd64, arm64): RUNTIME_BASE_PACKAGES and
    their dependencies extracted, finished by finish_runtime_base from the .debs mmdebstrap downloaded (copied
    out by its extract hook)."""
    hooks = ["--extract-hook=mkdir -p {out}/debs && cp \"$1\"/var/cache/apt/archives/*.deb {out}/debs/"]

    def build(out: Path, tar: Path) -> None:
        finish_runtime_base(out / "mmdebstrap.tar", sorted((out / "debs").glob("*.deb")), tar)
        (out / "mmdebstrap.tar").unlink()
        shutil.rmtree(out / "debs")

    return _mmdebstrap_rootfs("python-runtime-base", "extract", RUNTIME_BASE_PACKAGES, hooks, build, arch)


def _deb_fields(deb: Path) -> str:
    return _run(["dpkg-deb", "--field", str(deb)]).stdout.strip()


def _deb_members(deb: Path) -> list[str]:
    """The paths of a .deb's data, as mmdebstrap's tarball names them ("./usr/bin/...")."""
    listing = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(listing)) as data:
        return [m.name if m.name.startswith("./") else "./" + m.name for m in data.getmembers()]


def _deb_md5sums(deb: Path) -> str:
    got = subprocess.run(["dpkg-deb", "--info", str(deb), "md5sums"], capture_output=True, text=True)
    return got.stdout if got.returncode == 0 else ""


def finish_runtime_base(extracted: Path, debs: list[Path], out: Path) -> None:
    """mmdebstrap's extracted tarball rewritten into `out`, member order and metadata kept: without the
    packages left out, the commands and apt's and dpkg's files; with what the maintainer scripts would have
    made and a distroless image has: dpkg's record of each package (var/lib/dpkg/status.d/NAME and
    NAME.md5sums, the layout distroless uses and scanners read), the CA bundle (update-ca-certificates' job),
    /etc/passwd and /etc/group with the non-root user 65532 and its home."""
    packages = {}
    for deb in debs:
        fields = _deb_fields(deb)
        name = re.search(r"^Package: (\S+)$", fields, re.M).group(1)
        packages[name] = (fields, _deb_members(deb), _deb_md5sums(deb))
    kept_members = {m for name, (_f, members, _m) in packages.items() if name not in RUNTIME_BASE_LEFT_OUT
                    for m in members}
    gone = {m for name in RUNTIME_BASE_LEFT_OUT if name in packages for m in packages[name][1]} - kept_members

    def dropped(member: tarfile.TarInfo) -> bool:
        name = member.name if not member.isdir() else member.name.rstrip("/") + "/"
        if member.name in gone or name in gone:
            return True
        if any(name.startswith(d) for d in RUNTIME_BASE_DROPPED_DIRS):
            return True
        return (not member.isdir() and any(name.startswith(d) for d in RUNTIME_BASE_COMMAND_DIRS)
                and name != f".{PYTHON}")

    def added(path: str, data: bytes, mode: int = 0o644, uid: int = 0) -> tuple[tarfile.TarInfo, bytes]:
        info = tarfile.TarInfo(path)
        info.size, info.mode, info.mtime, info.uid, info.gid = len(data), mode, BASE_EPOCH, uid, uid
        return info, data

    def directory(path: str, mode: int = 0o755, uid: int = 0) -> tuple[tarfile.TarInfo, None]:
        info = tarfile.TarInfo(path)
        info.type, info.mode, info.mtime, info.uid, info.gid = tarfile.DIRTYPE, mode, BASE_EPOCH, uid, uid
        return info, None

    with tarfile.open(extracted) as src:
        members = [m for m in src.getmembers() if not dropped(m)]
        names = {m.name for m in members}
        certs = sorted(m.name for m in members if m.name.startswith("./usr/share/ca-certificates/mozilla/")
                       and m.name.endswith(".crt"))
        bundle = b"".join(src.extractfile(c).read().rstrip(b"\n") + b"\n" for c in certs)
        extra = [directory("./var/lib/dpkg/"), directory("./var/lib/dpkg/status.d/")]
        for name in sorted(packages):
            if name in RUNTIME_BASE_LEFT_OUT:
                continue
            fields, _members, md5sums = packages[name]
            extra.append(added(f"./var/lib/dpkg/status.d/{name}", (fields + "\n").encode()))
            sums = "".join(line + "\n" for line in md5sums.splitlines()
                           if f"./{line.split(maxsplit=1)[-1]}" in names)
            if sums:
                extra.append(added(f"./var/lib/dpkg/status.d/{name}.md5sums", sums.encode()))
        extra.append(added("./etc/ssl/certs/ca-certificates.crt", bundle))
        extra.append(added("./etc/passwd", b"root:x:0:0:root:/root:/sbin/nologin\n"
                           b"nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n"
                           b"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"))
        extra.append(added("./etc/group", b"root:x:0:\nnogroup:x:65534:\nnonroot:x:65532:\n"))
        extra.append(directory("./home/nonroot/", 0o700, 65532))
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
            for member in members:
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
            for info, data in extra:
                if info.name in names or info.name.rstrip("/") in names:
                    raise RuntimeError(f"{info.name} is already in the extracted packages")
                dst.addfile(info, io.BytesIO(data) if data is not None else None)


_BASES: dict[tuple[str, str], str] = {}


def push_bases(registry: Registry) -> tuple[str, str]:
    """The build base and the distroless runtime base as one-layer OCI images (platform linux/amd64, PATH
    set) in `registry`: their digest references."""
    for repo, rootfs, cmd in ((BUILD_BASE_REPO, build_base_rootfs, ["python3"]),
                              (RUNTIME_BASE_REPO, runtime_base_rootfs, [PYTHON])):
        if (registry.host, repo) not in _BASES:
            tar = rootfs()
            started = time.monotonic()
            _BASES[registry.host, repo] = registry.push_layers(repo, [tar], env=BASE_ENV, cmd=cmd,
                                                               tag=f"{BASE_SUITE}-python3")
            TIMINGS[f"{repo} import (crane append + mutate)"] = time.monotonic() - started
    return _BASES[registry.host, BUILD_BASE_REPO], _BASES[registry.host, RUNTIME_BASE_REPO]


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
              no_cache: bool = False, rewrite_timestamp: bool = True, platforms: tuple[str, ...] = (),
              cache_from: Path | None = None, cache_to: Path | None = None) -> dict:
        """Build `context`'s Dockerfile with the built-in dockerfile.v0 frontend, with its provenance
        attestation (mode=max), into the OCI layout directory `out`, for `platforms` (default: the worker's,
        linux/amd64); returns buildctl's metadata (containerimage.digest among it). `cache_from` is a local
        cache (an OCI layout of BuildKit's) to take steps from, `cache_to` where this build's is written."""
        meta = out.parent / f"{out.name}.metadata.json"
        args = ["build", "--frontend", "dockerfile.v0", "--local", f"context={context}",
                "--local", f"dockerfile={context}", "--progress", "plain", "--metadata-file", str(meta),
                "--opt", "filename=Dockerfile", "--opt", "attest:provenance=mode=max"]
        for key, value in build_args.items():
            args += ["--opt", f"build-arg:{key}={value}"]
        for sid, src in secrets.items():
            args += ["--secret", f"id={sid},src={src}"]
        if no_cache:
            args += ["--no-cache"]
        if platforms:
            args += ["--opt", "platform=" + ",".join(platforms)]
        if cache_from is not None:
            args += ["--import-cache", f"type=local,src={cache_from}"]
        if cache_to is not None:
            args += ["--export-cache", f"type=local,dest={cache_to},mode=max"]
        # The name is the attestation's subject (as `-t` would give it); the layout is pushed under any name.
        output = f"type=oci,tar=false,dest={out},name=docker.io/library/{REPO}:e2e"
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
        def workers() -> bool:
            ready = subprocess.run([str(bins / "buildctl"), "--addr", addr, "debug", "workers"],
                                   capture_output=True, text=True, timeout=30)
            if ready.returncode == 0 and len(ready.stdout.splitlines()) > 1:
                return True
            raise RuntimeError(ready.stderr)  # the last one is reported on timeout

        started_ready("buildkitd", workers, 60, proc, log, every=0.3)
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
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
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
                 secrets: dict[str, Path] | None = None, runtime_base: str | None = None,
                 platforms: tuple[str, ...] = ()) -> Path:
    """The Dockerfile of `context` built on the Debian base (pushed to `registry`) into the OCI layout `out`,
    by a buildkitd of its own unless `kit` is given; `secrets` default to the host's (proxy_secrets). For
    other `platforms` than linux/amd64, `runtime_base` is an index that has them."""
    build_base, amd64_runtime_base = push_bases(registry)
    runtime_base = runtime_base or amd64_runtime_base
    out.parent.mkdir(parents=True, exist_ok=True)
    build_args = {"BUILD_BASE": build_base, "RUNTIME_BASE": runtime_base, "SOURCE_DATE_EPOCH": str(context.epoch)}
    with contextlib.ExitStack() as stack:
        if kit is None:
            started = time.monotonic()
            kit = stack.enter_context(buildkitd([registry.host]))
            TIMINGS["buildkitd start"] = time.monotonic() - started
        started = time.monotonic()
        cache_from, cache_to = (None, None) if no_cache else stack.enter_context(
            steps_cache(f"{context.epoch} {rewrite_timestamp} {','.join(platforms)}"))
        kit.build(context.dir, out, build_args, proxy_secrets(out.parent) if secrets is None else secrets,
                  no_cache=no_cache, rewrite_timestamp=rewrite_timestamp, platforms=platforms,
                  cache_from=cache_from, cache_to=cache_to)
        TIMINGS[f"image build ({out.name})"] = time.monotonic() - started
    return out


@contextlib.contextmanager
def steps_cache(key: str):
    """BuildKit's cache of the image's steps (type=local, mode=max), kept in the e2e cache across builds and runs:
    yields where to import it from (None the first time) and where to export this build's, which then takes its
    place. The second build of a run (test_image's worker and the node suites' each build the image) and a warm
    run's find every step there: 9 s where 32. The lock is held for the build, so another worker's waits, then
    finds the steps. A run stopped between the renames leaves no cache (the next build makes every step again),
    never a half-written one. The from-scratch build (rebuild_from_scratch, --no-cache) takes none of it and
    must give the same image digest.

    `key` is what changes the layers' bytes but not BuildKit's cache keys: SOURCE_DATE_EPOCH, to which
    rewrite-timestamp clamps the files' times, above all. A cache made at another commit's time is not imported
    (its layers, every step of them cached, would keep that time: seen, a digest unlike the from-scratch one's)."""
    cache = toolchain.cache_root() / "buildkit-cache"
    fresh, old, made_for = (cache.with_name(f"{cache.name}{suffix}") for suffix in (".new", ".old", ".key"))
    with toolchain.cache_lock(cache.name):
        for leftover in (fresh, old):
            shutil.rmtree(leftover, ignore_errors=True)
        same = (cache / "index.json").exists() and made_for.exists() and made_for.read_text() == key
        yield (cache if same else None), fresh
        made_for.unlink(missing_ok=True)
        if cache.exists():
            cache.rename(old)
        fresh.rename(cache)
        made_for.write_text(key)
        shutil.rmtree(old, ignore_errors=True)


def layout_digest(layout: Path) -> str:
    """The digest of what an OCI layout directory holds (BuildKit's: the index of the image and its
    attestations)."""
    return json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]


def layout_blob(layout: Path, digest: str) -> dict:
    return json.loads((layout / "blobs" / "sha256" / digest.split(":", 1)[1]).read_text())


def image_descriptor(index: dict) -> dict:
    """The linux/amd64 image's descriptor in an image index (beside BuildKit's attestation manifest)."""
    images = [m for m in index["manifests"] if m.get("platform", {}).get("os") == "linux"
              and m["platform"].get("architecture") == "amd64"]
    assert len(images) == 1, index
    return images[0]


def attestation_descriptor(index: dict, image_digest: str) -> dict:
    """BuildKit's attestation manifest for `image_digest` in an image index."""
    found = [m for m in index["manifests"]
             if m.get("annotations", {}).get("vnd.docker.reference.type") == "attestation-manifest"
             and m["annotations"].get("vnd.docker.reference.digest") == image_digest]
    assert len(found) == 1, index
    return found[0]


@dataclass
class _Session:
    work: Path
    context: Context
    layout: Path | None = None
    pushed: dict[str, str] = field(default_factory=dict)


_SESSION: list[_Session] = []


def build_session() -> _Session:
    """This session's work directory and its snapshot of the build context (every build starts from it)."""
    if not _SESSION:
        work = Path(tempfile.mkdtemp(prefix="dispatch-admission-image-"))
        atexit.register(shutil.rmtree, work, ignore_errors=True)
        _SESSION.append(_Session(work, snapshot_context(work / "context")))
    return _SESSION[0]


_BUILDING = threading.Lock()  # one build at a time in this process: a prebuild's thread and the test that needs it


def build_webhook_image(registry: Registry) -> str:
    """The webhook image, built once per session, pushed to `registry`: `HOST/dispatch-admission@sha256:...`."""
    with _BUILDING:
        session = build_session()
        if registry.host not in session.pushed:
            if session.layout is None:
                session.layout = build_layout(registry, session.context, session.work / "layout")
            session.pushed[registry.host] = registry.push_oci_layout(REPO, session.layout)
        return session.pushed[registry.host]


def prebuild_webhook_image(registry: Registry, nice: int | None = None) -> threading.Thread:
    """`build_webhook_image(registry)` started in a thread: the node suites wait on pods meanwhile, and
    test_install's fixture then finds the image pushed (or waits for the build to end). A failure here is left
    for that fixture's own call to raise. `nice`: the thread's (and the build's) nice value, where the caller's
    would be inherited."""
    def build() -> None:
        if nice is not None:  # the image is needed minutes later, the node's start now
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, nice)
        with contextlib.suppress(Exception):
            build_webhook_image(registry)

    thread = threading.Thread(target=build, name="prebuild-webhook-image", daemon=True)
    thread.start()
    return thread


def python_version() -> str:
    """The image's Python, "3.13", from the interpreter's path."""
    return re.fullmatch(r".*/python(\d+\.\d+)", PYTHON).group(1)


def _pip_for_image(args: list[str]) -> list[str]:
    """`pip ARGS` of this machine's pip (Python 3.11) choosing the wheels the image's pip would: its Python,
    glibc 2.41 (trixie's) on x86_64 (pip does not widen a --platform to the older manylinux tags itself)."""
    abi = "cp" + python_version().replace(".", "")
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(41, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return [sys.executable, "-m", "pip", *args, "--only-binary=:all:", "--python-version", python_version(),
            "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
            *(arg for p in platforms for arg in ("--platform", p))]


def lock_wheels() -> Path:
    """Every wheel requirements/image.lock pins, for the image's Python (3.13, glibc, x86_64), downloaded
    with hashes checked; cached by the lock's hash."""
    lock = ROOT / "requirements" / "image.lock"
    key = hashlib.sha256(lock.read_bytes() + PYTHON.encode()).hexdigest()[:12]
    out = toolchain.cache_root() / f"wheels-{key}"
    with toolchain.cache_lock(out.name):
        if not (out / ".complete").exists():
            shutil.rmtree(out, ignore_errors=True)
            _run(_pip_for_image(["download", "--quiet", "--no-deps", "--require-hashes", "-r", str(lock),
                                 "-d", str(out)]))
            (out / ".complete").write_text("")
    return out


@contextlib.contextmanager
def local_index(wheels: Path):
    """The wheels served on loopback as a pip find-links page (http.server's directory listing)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                             "--directory", str(wheels)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listing() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
                return True

        started_ready("the local package index", listing, 30, proc, every=0.2)
        yield f"http://127.0.0.1:{port}/"
    finally:
        stop(proc)


def rebuild_from_scratch(registry: Registry) -> Path:
    """The session's context built again as a user elsewhere would: a new buildkitd with no cache, no CA
    secret, and the index given only as the `pipconf` secret (a pip.conf pointing at the lock's wheels on
    a loopback index). Same base and SOURCE_DATE_EPOCH: a reproducible build gives the first digest."""
    session = build_session()
    build_webhook_image(registry)
    out = session.work / "rebuild"
    if not out.exists():
        with local_index(lock_wheels()) as url:
            conf = session.work / "rebuild-pip.conf"
            conf.write_text(f"[global]\nno-index = true\nfind-links = {url}\n")
            build_layout(registry, session.context, out, no_cache=True, secrets={"pipconf": conf})
    return out


# ---- the image's SBOMs ----

CYCLONEDX_BOM = "7.5.0"  # cyclonedx-bom from PyPI: the `cyclonedx-py` command


def cyclonedx_bom_dir() -> Path:
    """cyclonedx-bom and its dependencies, as wheels for the image's Python, installed into a directory of
    their own (cached): put on sys.path of the image's interpreter, never into the image's venv."""
    out = toolchain.cache_root() / f"cyclonedx-bom-{CYCLONEDX_BOM}-py{python_version()}"
    with toolchain.cache_lock(out.name):
        if not (out / ".complete").exists():
            shutil.rmtree(out, ignore_errors=True)
            _run(_pip_for_image(["install", "--quiet", "--no-compile", "--target", str(out / "lib"),
                                 f"cyclonedx-bom=={CYCLONEDX_BOM}"]))
            (out / ".complete").write_text("")
    return out / "lib"


def python_sbom(rootfs: Path, config: dict) -> dict:
    """The CycloneDX SBOM of the image's Python layer: `cyclonedx-py environment /opt/venv/bin/python` run in
    the image (its interpreter, isolated from the venv, with cyclonedx-bom bind-mounted; the venv's
    interpreter is asked for its sys.path), pyproject.toml as the main component."""
    code = ("import runpy, sys; sys.path.insert(0, '/sbom/lib'); sys.argv = ['cyclonedx-py', 'environment', "
            "'--output-reproducible', '--pyproject', '/sbom/pyproject.toml', '/opt/venv/bin/python']; "
            "runpy.run_module('cyclonedx_py', run_name='__main__', alter_sys=True)")
    got = run_in_image(rootfs, config, [PYTHON, "-I", "-c", code], timeout=300,
                       mounts={"/sbom/lib": cyclonedx_bom_dir(), "/sbom/pyproject.toml": ROOT / "pyproject.toml"})
    if got.returncode != 0:
        raise RuntimeError(f"cyclonedx-py failed ({got.returncode}):\n{got.stderr[-4000:]}")
    return json.loads(got.stdout)


def image_sbom(registry: Registry, ref: str) -> dict:
    """The CycloneDX SBOM of the whole image (Debian's packages from dpkg's records, the venv's
    distributions...): `syft scan registry:REF` (syft from its Go module) on the pushed image."""
    started = time.monotonic()
    env = {**os.environ, "SYFT_REGISTRY_INSECURE_USE_HTTP": "true", "SYFT_CHECK_FOR_APP_UPDATE": "false"}
    got = _run([str(toolchain.syft_bin() / "syft"), "scan", f"registry:{ref}", "--platform", "linux/amd64",
                "--output", "cyclonedx-json", "--quiet"], timeout=900, env=env)
    TIMINGS["image SBOM (syft)"] = time.monotonic() - started
    return json.loads(got.stdout)


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
            total = sum(len(c) for c in iter(lambda blob=blob: blob.stdout.read(1 << 20), b""))
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
                 user: str | None = None, timeout: float = 60, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`args` run under runc in `rootfs` as the image config says (its user, env, working dir) with a
    read-only root, no network but loopback, files bind-mounted read-only from `mounts`, `stdin` as input."""
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
                              capture_output=True, text=True, timeout=timeout,
                              **({"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}))
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


# ---- what the image must hold (tests/e2e/test_image.py, test_signed_image.py) ----

def expected_distributions() -> dict[str, str]:
    """What the venv must hold: every distribution of the lock (less the build-only ones: the build backend
    and PyPA's installer, which the build stage keeps out of the venv) and the package itself, canonical
    name -> version."""
    lock = {}
    for line in re.sub(r"\\\n", " ", (ROOT / "requirements" / "image.lock").read_text()).splitlines():
        m = re.match(r"([A-Za-z0-9._-]+)==(\S+)", line)
        if m:
            lock[canonicalize_name(m.group(1))] = m.group(2)
    build_only = {"pip", "setuptools", "wheel", "installer"}
    expected = {n: v for n, v in lock.items() if n not in build_only}
    expected["dispatch-admission"] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return expected


def dpkg_records(rootfs: Path) -> dict[str, str]:
    """Debian package -> version, from dpkg's records in the image (distroless's var/lib/dpkg/status.d/)."""
    records = {}
    for path in sorted((rootfs / "var/lib/dpkg/status.d").iterdir()):
        if not path.name.endswith(".md5sums"):
            text = path.read_text()
            package = re.search(r"^Package: (\S+)$", text, re.M).group(1)
            records[package] = re.search(r"^Version: (\S+)$", text, re.M).group(1)
    return records


def sbom_packages(sbom: dict, purl_type: str) -> dict[str, str]:
    """name -> version of the SBOM's components whose package URL is of `purl_type` (deb, pypi)."""
    found = {}
    for component in sbom.get("components", []):
        if component.get("purl", "").startswith(f"pkg:{purl_type}/"):
            name = canonicalize_name(component["name"]) if purl_type == "pypi" else component["name"]
            assert found.setdefault(name, component["version"]) == component["version"], component
    return found
