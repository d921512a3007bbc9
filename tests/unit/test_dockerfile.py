"""The Dockerfile and the image's lock, read as text. The image itself is built by BuildKit and checked in
tests/e2e/test_image.py; these catch a broken rule in seconds, without a builder."""

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers import ROOT

TEXT = (ROOT / "Dockerfile").read_text()
STAGES = re.split(r"^FROM ", TEXT, flags=re.M)[1:]
BUILD, FINAL = STAGES[0], STAGES[-1]
LOCK = ROOT / "requirements" / "image.lock"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(stage: str) -> list[str]:
    """The stage's instructions, continuation lines joined, comments dropped."""
    lines = [line for line in stage.splitlines() if not line.lstrip().startswith("#")]
    return [i.strip() for i in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if i.strip()]


def lock_pins() -> dict[str, tuple[Version, list[str]]]:
    """name -> (pinned version, hashes) for every requirement of the lock; fails on anything unpinned."""
    text = re.sub(r"\\\n", " ", LOCK.read_text())
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})*)", line)
        assert m, f"not a hash-pinned requirement: {line!r}"
        pins[canonicalize_name(m.group(1))] = (Version(m.group(2)), re.findall(r"sha256:([0-9a-f]{64})", m.group(3)))
    return pins


def test_multi_stage_on_debian_13_bases_pinned_by_digest():
    assert len(STAGES) == 2
    build = re.search(r"^ARG BUILD_BASE=(\S+)$", TEXT, re.M).group(1)
    runtime = re.search(r"^ARG RUNTIME_BASE=(\S+)$", TEXT, re.M).group(1)
    assert re.fullmatch(r"debian:(trixie|13)-slim@sha256:[0-9a-f]{64}", build)
    assert re.fullmatch(r"gcr\.io/distroless/python3-debian13@sha256:[0-9a-f]{64}", runtime)
    assert BUILD.startswith("--platform=$BUILDPLATFORM ${BUILD_BASE} AS build\n")
    assert FINAL.startswith("${RUNTIME_BASE}\n")
    # The venv is made by the interpreter the distroless base has, at the same path.
    assert re.search(r"^ARG PYTHON=/usr/bin/python3\.13$", TEXT, re.M)
    assert any(re.search(r'"\$PYTHON" -m venv --without-pip /opt/venv;', i) for i in instructions(BUILD))


def test_no_syntax_directive_so_the_builtin_frontend_is_used():
    # `# syntax=` makes BuildKit pull a frontend image; the built-in dockerfile.v0 needs nothing pulled.
    assert not re.search(r"^#\s*syntax\s*=", TEXT, re.M | re.I)


def test_build_stage_fetches_the_lock_only_with_hashes_and_wheels():
    runs = [i for i in instructions(BUILD) if i.startswith("RUN ")]
    lock_fetch = [r for r in runs if "-r /tmp/image.lock" in r]
    assert len(lock_fetch) == 1
    assert "pip download" in lock_fetch[0]
    assert "--require-hashes" in lock_fetch[0] and "--only-binary=:all:" in lock_fetch[0]
    assert "COPY requirements/image.lock /tmp/image.lock" in instructions(BUILD)
    # The package itself brings nothing new: no index, no dependencies, the locked build backend.
    own = [r for r in runs if re.search(r"pip wheel .* \.(\s|;|$)", r)]
    assert len(own) == 1
    assert all(flag in own[0] for flag in ("--no-index", "--no-deps", "--no-build-isolation"))
    # The consistency check pip check made: the package resolved from the fetched wheels alone.
    assert re.search(r"pip install --quiet --dry-run --ignore-installed --no-index --find-links /tmp/wheels ", own[0])
    # The venv gets every wheel but the build-only ones (installed in /tmp/tools), and no pip.
    assert "setuptools-*|wheel-*|installer-*) ;;" in own[0]
    assert "/opt/venv/bin/python -m installer --no-compile-bytecode --validate-record=all" in own[0]
    assert "/opt/venv/bin/pip" not in BUILD


def test_no_step_runs_on_the_target_platform():
    """A multi-platform build (linux/arm64 on an amd64 builder) needs no emulation: every stage that runs
    something runs on the builder's platform, and the final stage (the target's) runs nothing."""
    for stage in STAGES:
        if any(i.startswith("RUN ") for i in instructions(stage)):
            assert stage.startswith("--platform=$BUILDPLATFORM "), stage.splitlines()[0]
    lock_fetch = next(i for i in instructions(BUILD) if "-r /tmp/image.lock" in i)
    # The target's wheels: its CPU from TARGETARCH, both platforms the image is published for.
    assert re.search(r"^ARG TARGETARCH$", BUILD, re.M)
    assert "amd64) machine=x86_64 ;;" in lock_fetch and "arm64) machine=aarch64 ;;" in lock_fetch
    assert "--platform manylinux_2_${minor}_$machine" in lock_fetch and "--abi cp$py" in lock_fetch


def test_proxy_ca_and_index_settings_are_optional_build_secrets():
    lock_fetch = next(i for i in instructions(BUILD) if "-r /tmp/image.lock" in i)
    for secret in ("pipcert", "pipconf"):
        assert f"--mount=type=secret,id={secret},required=false" in lock_fetch
    assert re.search(r"^ARG PIP_CERT=/run/secrets/pipcert$", BUILD, re.M)
    assert re.search(r"^ARG PIP_CONFIG_FILE=/run/secrets/pipconf$", BUILD, re.M)
    # Without the secret the variable is dropped, so a plain `docker build` uses pip's own CA bundle.
    assert '[ -s "$PIP_CERT" ] || unset PIP_CERT' in lock_fetch
    # Nothing about the index or the CA is declared where it would reach the final image.
    assert not re.search(r"PIP_(CERT|CONFIG_FILE|INDEX_URL|EXTRA_INDEX_URL|TRUSTED_HOST)|secret", FINAL)


def test_final_stage_only_copies_the_venv():
    final = instructions(FINAL)
    assert "COPY --from=build /opt/venv /opt/venv" in final
    # A distroless base has no shell: the final stage runs nothing, and copies nothing else in.
    assert not [i for i in final if i.startswith(("RUN ", "ADD "))]
    assert [i for i in final if i.startswith("COPY ")] == ["COPY --from=build /opt/venv /opt/venv"]
    assert re.search(r"^ENV .*PATH=/opt/venv/bin:\$PATH", FINAL, re.M)


def test_runs_as_a_numeric_non_root_user():
    users = re.findall(r"^USER (\S+)$", FINAL, re.M)
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1])


def test_entrypoint_is_the_serve_command():
    assert re.search(r'^ENTRYPOINT \["dispatch-admission"\]$', TEXT, re.M)
    assert re.search(r'^CMD \["serve"', TEXT, re.M)


def test_chart_runs_the_image_as_the_same_user():
    values = (ROOT / "charts" / "dispatch-admission" / "templates" / "deployment.yaml").read_text()
    uid = re.findall(r"^USER (\d+):", FINAL, re.M)[-1]
    assert f"runAsUser: {uid}" in values or f"runAsUser: {uid}" in (
        ROOT / "charts" / "dispatch-admission" / "values.yaml").read_text()


def test_the_lock_pins_every_runtime_dependency_with_hashes():
    pins = lock_pins()
    for spec in PYPROJECT["project"]["dependencies"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not in {LOCK.name}: run `make lock`"
        version, hashes = pins[name]
        assert req.specifier.contains(version, prereleases=True), f"{name}=={version} does not satisfy {spec}"
        assert hashes, f"{name} has no hash"


def test_the_lock_pins_the_build_backend():
    pins = lock_pins()
    for spec in PYPROJECT["build-system"]["requires"]:
        req = Requirement(spec)
        assert req.specifier.contains(pins[canonicalize_name(req.name)][0])


def test_dockerignore_admits_exactly_what_the_dockerfile_copies():
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    copied = {src for line in instructions(TEXT) if line.startswith("COPY ") and "--from=" not in line
              for src in line.split()[1:-1]}
    assert ignore[0] == "*"  # everything out, then only what the image needs back in
    admitted = {p[1:] for p in ignore if p.startswith("!")}
    assert copied == admitted
