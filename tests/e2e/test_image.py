"""The image a user would build: the project's Dockerfile built by BuildKit (tests/e2e/image.py) on a base
made from Debian's packages, pushed to a loopback registry by digest, then looked into: its config, its
flattened file system (crane export), and commands run from it under runc with a read-only root."""

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
from tests.e2e.registry import Registry
from tests.helpers import EXAMPLES, ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETTINGS_IN_IMAGE = "/etc/dispatch-admission/settings/settings.json"

# What a compiler or a package manager would be called, wherever it sits in the file system.
COMPILERS = {"gcc", "cc", "c++", "g++", "cpp", "cc1", "cc1plus", "collect2", "clang", "clang++", "tcc", "ld",
             "ld.bfd", "ld.gold", "as", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-as", "x86_64-linux-gnu-ld"}
PACKAGE_MANAGERS = {"apt", "apt-get", "apt-cache", "apt-mark", "apt-key", "aptitude", "dpkg", "dpkg-deb", "dpkg-query",
                    "dpkg-divert", "pip", "pip3", "pip3.11", "easy_install", "uv", "conda", "poetry", "pipx"}
INSTALLER_MODULES = {"pip", "setuptools", "ensurepip", "wheel", "pkg_resources", "_distutils_hack"}


@dataclass
class Built:
    registry: Registry
    ref: str
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
        rootfs = image_mod.export_rootfs(registry, ref, tmp / "rootfs")
        yield Built(registry, ref, registry.config(ref), registry.manifest(ref), rootfs)
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


def test_pushed_by_digest_for_linux_amd64(built):
    assert re.fullmatch(r"127\.0\.0\.1:\d+/dispatch-admission@sha256:[0-9a-f]{64}", built.ref)
    assert (built.config["os"], built.config["architecture"]) == ("linux", "amd64")
    assert built.manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"


def test_runs_as_a_numeric_non_root_user(built):
    assert built.config["config"]["User"] == "65532:65532"
    got = built.run("python3", "-c", "import os; print(os.getuid(), os.getgid())")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["65532", "65532"]


def test_root_file_system_is_read_only_in_these_runs(built):
    got = built.run("sh", "-c", "touch /opt/venv/x", user="0:0")
    assert got.returncode != 0 and "Read-only file system" in got.stderr


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
    got = built.run("sh", "-c", " ".join(f"command -v {c};" for c in sorted(COMPILERS)) + " true")
    assert got.returncode == 0 and got.stdout == "", got.stdout


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
    got = built.run("sh", "-c", " ".join(f"command -v {c};" for c in sorted(PACKAGE_MANAGERS)) + " true")
    assert got.returncode == 0 and got.stdout == "", got.stdout
    # Debian's package database stays, so image scanners still see what the base holds.
    assert (built.rootfs / "var/lib/dpkg/status").stat().st_size > 0


def test_installed_distributions_are_exactly_the_lock(built):
    got = built.run("python3", "-c", "import importlib.metadata as m, json; "
                    "print(json.dumps(sorted((d.metadata['Name'], d.version) for d in m.distributions())))")
    assert got.returncode == 0, got.stderr
    installed = {canonicalize_name(n): v for n, v in json.loads(got.stdout)}
    lock = {}
    for line in re.sub(r"\\\n", " ", (ROOT / "requirements" / "image.lock").read_text()).splitlines():
        m = re.match(r"([A-Za-z0-9._-]+)==(\S+)", line)
        if m:
            lock[canonicalize_name(m.group(1))] = m.group(2)
    build_only = {"pip", "setuptools", "wheel"}
    expected = {n: v for n, v in lock.items() if n not in build_only}
    expected["dispatch-admission"] = PYPROJECT["project"]["version"]
    assert installed == expected


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
    sizes = image_mod.layer_sizes(built.registry, built.ref)
    base = image_mod.push_base(built.registry)
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
    (the lock's wheels on a loopback index), by a new buildkitd with no cache: the same manifest digest.
    So the optional secrets work both ways and leave nothing behind, and the build is reproducible: that
    takes BuildKit's rewrite-timestamp (layer file times clamped to SOURCE_DATE_EPOCH) and hash-based
    bytecode (pip's own compile writes each .pyc with its source's install time, which no timestamp
    rewriting reaches)."""
    again = image_mod.rebuild_from_scratch(built.registry)
    log = (again.parent / f"{again.name}.build.log").read_text()
    assert "Looking in links: http://127.0.0.1:" in log  # pip used the pipconf secret, not PyPI
    second = json.loads((again / "blobs" / "sha256" / image_mod.layout_digest(again).split(":")[1]).read_text())
    assert [layer["digest"] for layer in second["layers"]] == [layer["digest"] for layer in built.manifest["layers"]]
    assert image_mod.layout_digest(again) == built.ref.split("@")[1]
