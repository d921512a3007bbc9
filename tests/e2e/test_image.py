"""The image a user would build: the project's Dockerfile built by BuildKit (tests/e2e/image.py) on bases
made from Debian 13's packages (the final one distroless), pushed to a loopback registry by digest with its
provenance attestation, then looked into: its config, its flattened file system (crane export), commands run
from it under runc with a read-only root, its SBOMs (syft's of the image, cyclonedx-py's of the venv) and
its provenance."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.e2e import image as image_mod
from tests.e2e.image import dpkg_records, expected_distributions, sbom_packages
from tests.e2e.registry import Registry
from tests.helpers import EXAMPLES, ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETTINGS_IN_IMAGE = "/etc/dispatch-admission/settings/settings.json"

# What a compiler or a package manager would be called, wherever it sits in the file system.
COMPILERS = {"gcc", "cc", "c++", "g++", "cpp", "cc1", "cc1plus", "collect2", "clang", "clang++", "tcc", "ld",
             "ld.bfd", "ld.gold", "as", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-as", "x86_64-linux-gnu-ld"}
PACKAGE_MANAGERS = {"apt", "apt-get", "apt-cache", "apt-mark", "apt-key", "aptitude", "dpkg", "dpkg-deb", "dpkg-query",
                    "dpkg-divert", "pip", "pip3", "pip3.13", "easy_install", "uv", "conda", "poetry", "pipx"}
INSTALLER_MODULES = {"pip", "setuptools", "ensurepip", "wheel", "installer", "pkg_resources", "_distutils_hack"}
# Shells, and the commands of coreutils and of the other Essential packages a shell session would use.
SHELLS = {"sh", "bash", "dash", "rbash", "zsh", "ksh", "mksh", "busybox", "toybox"}
COREUTILS = {"ls", "cat", "cp", "mv", "rm", "ln", "mkdir", "chmod", "chown", "touch", "echo", "env", "id", "head",
             "tail", "test", "[", "dd", "sleep", "tee", "find", "xargs", "grep", "sed", "awk", "mawk", "tar",
             "gzip", "mount", "su", "login", "perl", "openssl", "wget", "curl"}
# Where commands are looked up (the image's PATH, less the venv's own bin).
COMMAND_DIRS = ("bin", "sbin", "usr/bin", "usr/sbin", "usr/local/bin", "usr/local/sbin")


@dataclass
class Built:
    registry: Registry
    ref: str  # what build_webhook_image returns: the image index (the image and its attestation manifest)
    index: dict
    image_ref: str  # the linux/amd64 image in it, by digest
    config: dict
    manifest: dict
    rootfs: Path

    def run(self, *args: str, mounts: dict[str, Path] | None = None, user: str | None = None):
        return image_mod.run_in_image(self.rootfs, self.config, list(args), mounts=mounts, user=user)

    @property
    def entrypoint(self) -> list[str]:
        return self.config["config"]["Entrypoint"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("image")
    registry = Registry.start(tmp / "registry")
    try:
        ref = image_mod.build_webhook_image(registry)
        index = registry.manifest(ref)
        image_ref = f"{ref.split('@')[0]}@{image_mod.image_descriptor(index)['digest']}"
        rootfs = image_mod.export_rootfs(registry, image_ref, tmp / "rootfs")
        yield Built(registry, ref, index, image_ref, registry.config(image_ref), registry.manifest(image_ref),
                    rootfs)
    finally:
        registry.stop()
        shutil.rmtree(tmp / "rootfs", ignore_errors=True)


def files_named(rootfs: Path, names: set[str], executable: bool = False) -> list[str]:
    """Paths (inside the image) of files, links or directories whose name is in `names`; with `executable`,
    only regular files with an execute bit and links (a link to a removed file is still reported)."""
    found = []
    for dirpath, dirs, files in os.walk(rootfs):
        for name in (files if executable else dirs + files):
            path = Path(dirpath, name)
            if name in names and (not executable or path.is_symlink() or os.stat(path).st_mode & 0o111):
                found.append("/" + str(path.relative_to(rootfs)))
    return sorted(found)


def in_image_path(built: Built, names: set[str]) -> list[str]:
    """Which of `names` the image's Python finds on the image's PATH (shutil.which: no shell needed)."""
    got = built.run("python3", "-c", "import json, shutil, sys; "
                    "print(json.dumps(sorted(n for n in json.loads(sys.argv[1]) if shutil.which(n))))",
                    json.dumps(sorted(names)))
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def test_pushed_by_digest_for_linux_amd64(built):
    assert re.fullmatch(r"127\.0\.0\.1:\d+/dispatch-admission@sha256:[0-9a-f]{64}", built.ref)
    # With its attestation, the image is pushed as an index: the image for linux/amd64 and its attestation
    # manifest (platform unknown/unknown, which containerd never picks).
    assert built.index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert len(built.index["manifests"]) == 2
    image = image_mod.image_descriptor(built.index)
    assert image["platform"] == {"architecture": "amd64", "os": "linux"}
    attestation = image_mod.attestation_descriptor(built.index, image["digest"])
    assert attestation["platform"] == {"architecture": "unknown", "os": "unknown"}
    assert (built.config["os"], built.config["architecture"]) == ("linux", "amd64")
    assert built.manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"


def test_runs_as_a_numeric_non_root_user(built):
    assert built.config["config"]["User"] == "65532:65532"
    got = built.run("python3", "-c", "import os; print(os.getuid(), os.getgid())")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["65532", "65532"]


def test_root_file_system_is_read_only_in_these_runs(built):
    got = built.run("python3", "-c", "open('/opt/venv/x', 'w')", user="0:0")
    assert got.returncode != 0 and "Read-only file system" in got.stderr


def test_debian_13_with_its_python_3_13(built):
    os_release = (built.rootfs / "etc/os-release").read_text()
    assert 'VERSION_ID="13"' in os_release.splitlines() and "VERSION_CODENAME=trixie" in os_release.splitlines()
    got = built.run("python3", "-c",
                    "import os, sys; print(sys.version_info[:2], os.path.realpath(sys._base_executable))")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "(3, 13) /usr/bin/python3.13"
    assert dpkg_records(built.rootfs)["python3.13-minimal"].startswith("3.13.")


def test_no_shell_and_no_coreutils_in_the_final_image(built):
    assert files_named(built.rootfs, SHELLS | COREUTILS, executable=True) == []
    for path in ("bin/sh", "usr/bin/sh", "bin/bash", "usr/bin/dash", "usr/bin/env"):
        assert not os.path.lexists(built.rootfs / path), path
    assert in_image_path(built, SHELLS | COREUTILS) == []
    # The interpreter is the only command outside the venv.
    commands = sorted({os.path.realpath(p) for d in COMMAND_DIRS if (built.rootfs / d).is_dir()
                       for p in (built.rootfs / d).iterdir() if not p.is_dir()})
    assert commands == [str(built.rootfs / "usr/bin/python3.13")]
    for shell in ("sh", "/bin/sh"):
        got = built.run(shell, "-c", "true")
        assert got.returncode != 0 and re.search(r"not found|no such file", got.stderr, re.I), got.stderr


def test_version_runs_in_the_image(built):
    got = built.run(*built.entrypoint, "--version")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == f"dispatch-admission {PYPROJECT['project']['version']}"


def test_settings_check_runs_in_the_image(built):
    ok = built.run(*built.entrypoint, "settings", "check", SETTINGS_IN_IMAGE,
                   mounts={SETTINGS_IN_IMAGE: EXAMPLES / "settings" / "route1.json"})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == f"{SETTINGS_IN_IMAGE}: valid"
    bad = built.run(*built.entrypoint, "settings", "check", SETTINGS_IN_IMAGE,
                    mounts={SETTINGS_IN_IMAGE: EXAMPLES / "settings" / "invalid.json"})
    assert bad.returncode == 1 and bad.stderr.startswith("ErrInvalid: "), (bad.stdout, bad.stderr)


def test_the_default_command_is_serve_with_the_chart_paths(built):
    cfg = built.config["config"]
    assert cfg["Entrypoint"] == ["dispatch-admission"]
    assert cfg["Cmd"][0] == "serve" and f"--settings={SETTINGS_IN_IMAGE}" in cfg["Cmd"]
    assert any(e.startswith("PATH=/opt/venv/bin:") for e in cfg["Env"])


def test_no_compiler_in_the_final_image(built):
    assert files_named(built.rootfs, COMPILERS, executable=True) == []
    assert in_image_path(built, COMPILERS) == []


def test_no_package_manager_or_installer_in_the_final_image(built):
    assert files_named(built.rootfs, PACKAGE_MANAGERS, executable=True) == []
    python_dirs = [p for p in built.rootfs.glob("usr/**/python3*") if p.is_dir()] + [built.rootfs / "opt/venv"]
    modules = [m for d in python_dirs for m in files_named(d, INSTALLER_MODULES)]
    assert modules == []
    assert sorted(str(p.relative_to(built.rootfs)) for p in built.rootfs.rglob("*.whl")) == []
    for python in ("python3", "/opt/venv/bin/python"):
        for module in ("pip", "ensurepip", "setuptools"):
            got = built.run(python, "-m", module, "--version")
            assert got.returncode != 0 and f"No module named {module}" in got.stderr, (python, module, got.stderr)
    assert in_image_path(built, PACKAGE_MANAGERS) == []
    for path in ("usr/bin/apt", "usr/bin/dpkg", "etc/apt", "var/lib/apt", "usr/lib/apt", "usr/lib/dpkg"):
        assert not os.path.lexists(built.rootfs / path), path
    # dpkg's records stay (distroless's layout, one file a package), so image scanners see what the base holds.
    assert {"libc6", "libssl3t64", "python3.13-minimal", "libpython3.13-stdlib",
            "base-files"} <= set(dpkg_records(built.rootfs))


def test_installed_distributions_are_exactly_the_lock(built):
    got = built.run("python3", "-c", "import importlib.metadata as m, json; "
                    "print(json.dumps(sorted((d.metadata['Name'], d.version) for d in m.distributions())))")
    assert got.returncode == 0, got.stderr
    installed = {canonicalize_name(n): v for n, v in json.loads(got.stdout)}
    assert installed == expected_distributions()


def test_build_secrets_and_index_settings_leave_no_trace(built, tmp_path):
    secrets = image_mod.proxy_secrets(tmp_path)
    assert "pipcert" in secrets  # this machine needs its proxy's CA: the build used the secret
    text = json.dumps(built.config)
    for trace in ("pipcert", "pipconf", "PIP_CERT", "PIP_CONFIG_FILE", "PIP_INDEX_URL", "/run/secrets", "secret"):
        assert trace not in text
    assert not (built.rootfs / "run/secrets").exists()
    assert files_named(built.rootfs, {"pip.conf", "pip.ini"}) == []
    # No file in the image holds the bytes of a secret the build was given.
    for src in secrets.values():
        data = src.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        same_size = [p for p in built.rootfs.rglob("*") if p.is_file() and not p.is_symlink()
                     and p.stat().st_size == len(data)]
        assert [p for p in same_size if hashlib.sha256(p.read_bytes()).hexdigest() == digest] == []


def test_image_size(built, record_property):
    sizes = image_mod.layer_sizes(built.registry, built.image_ref)
    base = image_mod.push_bases(built.registry)[1]
    base_layers = [layer["digest"] for layer in built.registry.manifest(base)["layers"]]
    # The final stage is the base and our layers on top of it.
    assert [d for d, _, _ in sizes[:len(base_layers)]] == base_layers
    compressed = sum(c for _, c, _ in sizes)
    uncompressed = sum(u for _, _, u in sizes)
    ours_compressed = sum(c for _, c, _ in sizes[len(base_layers):])
    ours_uncompressed = sum(u for _, _, u in sizes[len(base_layers):])
    figures = {"layers": len(sizes), "compressed_bytes": compressed, "uncompressed_bytes": uncompressed,
               "above_base_compressed_bytes": ours_compressed, "above_base_uncompressed_bytes": ours_uncompressed,
               "timings_s": {k: round(v) for k, v in image_mod.TIMINGS.items()}}
    for key, value in figures.items():
        record_property(key, value)
    print("image figures:", json.dumps(figures))
    # Our layers are the venv (kubernetes' client alone, with its bytecode, is about 130 MB of it): a jump
    # past this bound is a new heavy dependency or a build tool gone in.
    assert ours_uncompressed < 256 * 2**20


def test_a_build_elsewhere_from_scratch_is_the_same_image(built):
    """Built again as a user elsewhere would, with no CA secret and the index only as the `pipconf` secret
    (the lock's wheels on a loopback index), by a new buildkitd with no cache: the same image manifest
    digest. So the optional secrets work both ways and leave nothing behind, and the build is reproducible:
    that takes BuildKit's rewrite-timestamp (layer file times clamped to SOURCE_DATE_EPOCH) and hash-based
    bytecode (pip's own compile writes each .pyc with its source's install time, which no timestamp
    rewriting reaches). The provenance beside it is of another build (its secrets, its times), so the index
    differs, not the image."""
    again = image_mod.rebuild_from_scratch(built.registry)
    log = (again.parent / f"{again.name}.build.log").read_text()
    assert "Looking in links: http://127.0.0.1:" in log  # pip used the pipconf secret, not PyPI
    index = image_mod.layout_blob(again, image_mod.layout_digest(again))
    image = image_mod.image_descriptor(index)
    second = image_mod.layout_blob(again, image["digest"])
    assert [layer["digest"] for layer in second["layers"]] == [layer["digest"] for layer in built.manifest["layers"]]
    assert image["digest"] == built.image_ref.split("@")[1]


# ---- the SBOMs and the provenance ----

@pytest.fixture(scope="module")
def image_sbom(built):
    return image_mod.image_sbom(built.registry, built.ref)


def test_the_image_sbom_lists_the_debian_packages_and_the_lock(built, image_sbom):
    """syft's SBOM of the pushed image: every Debian package dpkg's records name, at its version, and every
    distribution of the venv at the lock's version."""
    assert image_sbom["bomFormat"] == "CycloneDX"
    debian = sbom_packages(image_sbom, "deb")
    assert debian and debian == dpkg_records(built.rootfs)
    assert sbom_packages(image_sbom, "pypi") == expected_distributions()
    distro = [c for c in image_sbom.get("components", []) if c.get("type") == "operating-system"]
    assert [c["name"] for c in distro] == ["debian"] and distro[0]["version"].split(".")[0] == "13"


def test_the_python_sbom_lists_every_distribution_of_the_lock(built):
    """cyclonedx-py's SBOM of the venv, made in the image by its own interpreter: the lock, each at its
    pinned version, with the project as its main component."""
    sbom = image_mod.python_sbom(built.rootfs, built.config)
    assert sbom["bomFormat"] == "CycloneDX"
    main = sbom["metadata"]["component"]
    assert (main["name"], main["version"]) == ("dispatch-admission", PYPROJECT["project"]["version"])
    # The project's own distribution is the main component; every other one is a component.
    assert sbom_packages(sbom, "pypi") | {"dispatch-admission": main["version"]} == expected_distributions()


def provenance(built: Built) -> dict:
    """The in-toto statement of BuildKit's provenance attestation for the image, from the registry."""
    image = image_mod.image_descriptor(built.index)
    attestation = image_mod.attestation_descriptor(built.index, image["digest"])
    manifest = built.registry.manifest(f"{built.ref.split('@')[0]}@{attestation['digest']}")
    layers = [layer for layer in manifest["layers"] if layer["mediaType"] == "application/vnd.in-toto+json"]
    assert len(layers) == 1, manifest
    assert layers[0]["annotations"]["in-toto.io/predicate-type"].startswith("https://slsa.dev/provenance/")
    return json.loads(built.registry.blob(built.ref, layers[0]["digest"]))


def test_the_provenance_attestation_names_the_dockerfile_build_of_this_image(built, tmp_path):
    statement = provenance(built)
    assert statement["_type"].startswith("https://in-toto.io/Statement/")
    image_digest = built.image_ref.split("@")[1]
    # The image as the build named it (`-t`), by the digest of the image manifest pushed.
    assert [(s["name"], s["digest"]) for s in statement["subject"]] == [
        (f"pkg:docker/{image_mod.REPO}@e2e?platform=linux%2Famd64", {"sha256": image_digest.split(":")[1]})]
    predicate = statement["predicate"]
    text = json.dumps(predicate)
    # BuildKit v0.34 writes SLSA provenance v1: the Dockerfile frontend on the file `Dockerfile` (as
    # `docker buildx build` sends it: --opt filename=Dockerfile) and what it read, by digest.
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    build = predicate["buildDefinition"]
    assert build["buildType"] == "https://github.com/moby/buildkit/blob/master/docs/attestations/slsa-definitions.md"
    assert build["externalParameters"]["configSource"]["path"] == "Dockerfile"
    request = build["externalParameters"]["request"]
    assert request["frontend"] == "dockerfile.v0"
    args = request["args"]
    materials = [m["uri"] for m in build["resolvedDependencies"]]
    assert predicate["runDetails"]["metadata"]["buildkit_completeness"]["request"] is True
    # mode=max: the build's arguments, and both bases it was built from, by digest.
    for name, base in zip(("BUILD_BASE", "RUNTIME_BASE"), image_mod.push_bases(built.registry), strict=True):
        assert args[f"build-arg:{name}"] == base
        repo, digest = base.split("@")
        assert any(repo.split("/", 1)[1] in uri and digest in uri for uri in materials), (base, materials)
    # The Dockerfile's secret mounts are named in it (both optional), never the contents of those given.
    assert sorted((s["id"], s.get("optional")) for s in request["secrets"]) == [("pipcert", True), ("pipconf", True)]
    for src in image_mod.proxy_secrets(tmp_path).values():
        assert src.read_text().strip() not in text
    assert "BEGIN CERTIFICATE" not in text
