"""The webhook's image for linux/amd64 and linux/arm64 in one OCI index, signed with cosign (issue 37).

- Both platforms come from the project's Dockerfile in one BuildKit request (`--opt platform=...`, as
  `docker buildx build --platform linux/amd64,linux/arm64`), with no emulation: this machine registers no
  binfmt handler and BuildKit's worker runs amd64 only. The Dockerfile's build stage runs on the builder's
  platform and installs the target's wheels (aarch64 ones from PyPI, hashes from the lock) with PyPA's
  installer; the final stage only copies the venv onto the runtime base. The arm64 runtime base is made as
  amd64's is, from Debian's arm64 packages (`mmdebstrap --variant=extract --architectures=arm64`: none of
  them runs), and both go to the registry as one index, the build's RUNTIME_BASE.
- cosign (from its Go module) makes a key pair, with a password it reads from COSIGN_PASSWORD, signs the
  index and each platform's image (`--recursive`) and attaches each image's SBOM (syft's, CycloneDX) as an
  attestation. All of it stays in the loopback registry: no transparency log, no certificate authority, no
  TUF root fetched; cosign runs with an environment and a HOME of its own.
- The arm64 image's commands run under qemu-user (Debian's qemu-user-static): qemu-aarch64-static, a static
  amd64 program, is bind-mounted into the container and started there with the image's interpreter.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.e2e import image as image_mod
from tests.e2e import toolchain
from tests.e2e.registry import Registry

PLATFORMS = ("linux/amd64", "linux/arm64")
TAG = "multiarch"
QEMU_PACKAGES = ("qemu-user-static",)
QEMU_IN_IMAGE = "/usr/local/qemu/qemu-aarch64-static"  # where the emulator is bind-mounted in a container
# Each container started under emulation gets this long (the interpreter's start alone is seconds under qemu).
QEMU_TIMEOUT_S = 300


def push_runtime_bases(registry: Registry) -> str:
    """The distroless runtime base for amd64 (push_bases' own) and for arm64 as one index in `registry`."""
    amd64 = image_mod.push_bases(registry)[1]
    started = time.monotonic()
    arm64 = registry.push_layers(image_mod.RUNTIME_BASE_REPO, [image_mod.runtime_base_rootfs("arm64")],
                                 platform="linux/arm64", env=image_mod.BASE_ENV, cmd=[image_mod.PYTHON],
                                 tag=f"{image_mod.BASE_SUITE}-python3-arm64")
    index = registry.push_index(image_mod.RUNTIME_BASE_REPO, [amd64, arm64], tag=f"{image_mod.BASE_SUITE}-python3")
    image_mod.TIMINGS["arm64 runtime base (mmdebstrap if not cached, import, index)"] = time.monotonic() - started
    return index


@dataclass(frozen=True)
class MultiArch:
    ref: str  # the index, HOST/dispatch-admission@sha256:...
    images: dict[str, str]  # "linux/arm64" -> that platform's image, by digest
    worker_platforms: list[str]  # what the BuildKit worker that built it can run


_BUILT: dict[str, MultiArch] = {}


def build_multiarch_image(registry: Registry) -> MultiArch:
    """The Dockerfile built for PLATFORMS (once per session, from the snapshot build_webhook_image builds)
    and pushed to `registry` as HOST/dispatch-admission:multiarch."""
    if registry.host not in _BUILT:
        session = image_mod.build_session()
        layout = session.work / "multiarch"
        runtime_bases = push_runtime_bases(registry)
        with image_mod.buildkitd([registry.host]) as kit:
            workers = json.loads(kit.buildctl("debug", "workers", "--format", "{{json .}}").stdout)
            can_run = sorted({f"{p['os']}/{p['architecture']}" for w in workers for p in w["platforms"]})
            image_mod.build_layout(registry, session.context, layout, kit=kit, runtime_base=runtime_bases,
                                   platforms=PLATFORMS)
        ref = registry.push_oci_layout(image_mod.REPO, layout, tag=TAG)
        _BUILT[registry.host] = MultiArch(ref, platform_images(registry, ref), can_run)
    return _BUILT[registry.host]


def platform_images(registry: Registry, index_ref: str) -> dict[str, str]:
    """"os/arch" -> digest reference of each image in an index (BuildKit's attestation manifests, platform
    unknown/unknown, left out)."""
    repo = index_ref.split("@")[0]
    return {f"{m['platform']['os']}/{m['platform']['architecture']}": f"{repo}@{m['digest']}"
            for m in registry.manifest(index_ref)["manifests"]
            if m.get("platform", {}).get("os") not in (None, "unknown")}


def image_sbom(ref: str, platform: str) -> dict:
    """syft's CycloneDX SBOM of the image `ref` for `platform`, from the registry."""
    env = {**os.environ, "SYFT_REGISTRY_INSECURE_USE_HTTP": "true", "SYFT_CHECK_FOR_APP_UPDATE": "false"}
    got = subprocess.run([str(toolchain.syft_bin() / "syft"), "scan", f"registry:{ref}", "--platform", platform,
                          "--output", "cyclonedx-json", "--quiet"], capture_output=True, text=True, timeout=900,
                         env=env)
    if got.returncode != 0:
        raise RuntimeError(f"syft scan {ref} failed ({got.returncode}):\n{got.stderr[-4000:]}")
    return json.loads(got.stdout)


# ---- cosign ----

# The local registry speaks plain HTTP.
REGISTRY_FLAGS = ("--allow-insecure-registry", "--allow-http-registry")
# Signing with a key, kept in the registry only: no Rekor entry, no timestamp authority, no signing config
# fetched from the public Sigstore instance (there is none to reach here, and a test key is nobody's business).
# The signatures in cosign's classic layout (a `sha256-DIGEST.sig` / `.att` tag beside the image), not v3's
# Sigstore bundle referrers: Kyverno 1.15's `verifyImages` (cosign v2 libraries) finds a key's signature only
# there, its bundle type being keyless-only; cosign v3's verify reads both.
SIGN_FLAGS = ("--use-signing-config=false", "--tlog-upload=false", "--new-bundle-format=false", "--yes")
# Verifying with the public key alone (the signature's existence in a transparency log is not asked for).
VERIFY_FLAGS = ("--insecure-ignore-tlog=true",)


@dataclass(frozen=True)
class Cosign:
    """cosign with a key pair of its own under `home` (cosign.key, encrypted with `password`; cosign.pub)."""
    home: Path
    password: str
    bin: Path

    @classmethod
    def with_new_key(cls, home: Path) -> Cosign:
        home.mkdir(parents=True, exist_ok=True)
        made = cls(home, secrets.token_urlsafe(24), toolchain.cosign_bin() / "cosign")
        made.run("generate-key-pair", "--output-key-prefix", str(home / "cosign"))
        return made

    @property
    def public_key(self) -> Path:
        return self.home / "cosign.pub"

    @property
    def private_key(self) -> Path:
        return self.home / "cosign.key"

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        # Only what cosign needs: no proxy (loopback only), no Sigstore settings or caches of the host's.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home),
               "TUF_ROOT": str(self.home / "tuf"), "COSIGN_PASSWORD": self.password}
        got = subprocess.run([str(self.bin), *args], capture_output=True, text=True, timeout=300, env=env,
                             cwd=self.home, stdin=subprocess.DEVNULL)
        if check and got.returncode != 0:
            raise RuntimeError(f"cosign {' '.join(args)} failed ({got.returncode}):\n{got.stderr[-4000:]}")
        return got

    def sign(self, ref: str, recursive: bool = False) -> subprocess.CompletedProcess:
        """Sign `ref` (a digest reference); `recursive`: an index and every manifest in it."""
        return self.run("sign", "--key", str(self.private_key), *SIGN_FLAGS, *REGISTRY_FLAGS,
                        *(["--recursive"] if recursive else []), ref)

    def attest(self, ref: str, predicate: Path, predicate_type: str = "cyclonedx") -> subprocess.CompletedProcess:
        return self.run("attest", "--key", str(self.private_key), "--type", predicate_type, "--predicate",
                        str(predicate), *SIGN_FLAGS, *REGISTRY_FLAGS, ref)

    def verify(self, ref: str, key: Path | None = None) -> subprocess.CompletedProcess:
        """`cosign verify` of `ref` with the public key (or `key`); not raising: the result is what is tested."""
        return self.run("verify", "--key", str(key or self.public_key), *VERIFY_FLAGS, *REGISTRY_FLAGS, ref,
                        check=False)

    def verify_attestation(self, ref: str, predicate_type: str = "cyclonedx") -> subprocess.CompletedProcess:
        return self.run("verify-attestation", "--key", str(self.public_key), "--type", predicate_type,
                        *VERIFY_FLAGS, *REGISTRY_FLAGS, ref, check=False)


def sign_with_sboms(cosign: Cosign, built: MultiArch, out: Path) -> dict[str, dict]:
    """The index and its images signed (`--recursive`), and each image's SBOM (syft's, kept under `out`)
    attached as a signed CycloneDX attestation: platform -> SBOM."""
    started = time.monotonic()
    cosign.sign(built.ref, recursive=True)
    sboms = {}
    for platform, ref in built.images.items():
        sboms[platform] = image_sbom(ref, platform)
        predicate = out / f"sbom-{platform.replace('/', '-')}.cdx.json"
        predicate.write_text(json.dumps(sboms[platform]))
        cosign.attest(ref, predicate)
    image_mod.TIMINGS["sign, SBOMs (syft) and attest"] = time.monotonic() - started
    return sboms


# ---- the arm64 image under qemu-user ----

def qemu_aarch64() -> Path:
    """Debian's qemu-aarch64-static (installed once, like the node's packages): a static amd64 program."""
    toolchain.apt_install(QEMU_PACKAGES)
    return Path(shutil.which("qemu-aarch64-static") or "/usr/bin/qemu-aarch64-static")


def binfmt_handlers() -> list[str]:
    """The binfmt_misc handlers this kernel has registered (none: no foreign program runs by itself)."""
    root = Path("/proc/sys/fs/binfmt_misc")
    return sorted(p.name for p in root.iterdir() if p.name not in ("register", "status")) if root.is_dir() else []


def run_emulated(rootfs: Path, config: dict, args: list[str], *, mounts: dict[str, Path] | None = None,
                 stdin: str | None = None) -> subprocess.CompletedProcess:
    """`args` (args[0] an aarch64 program of the image) run in the arm64 image's `rootfs` under runc, started
    by qemu-aarch64-static mounted into the container, as the image config says (its user, env)."""
    mounts = {QEMU_IN_IMAGE: qemu_aarch64(), **(mounts or {})}
    return image_mod.run_in_image(rootfs, config, [QEMU_IN_IMAGE, *args], mounts=mounts, stdin=stdin,
                                  timeout=QEMU_TIMEOUT_S)
