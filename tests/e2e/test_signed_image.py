"""The signed multi-platform image (tests/e2e/signed_image.py): the Dockerfile built for linux/amd64 and
linux/arm64 in one OCI index with no emulation, pushed to a loopback registry, signed with cosign and a key
made here, each image's SBOM attached as a signed attestation; then verified as a user would (`cosign
verify` with the public key), tampered with, and the arm64 image run under qemu-user."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.utils import canonicalize_name

from tests.e2e import image as image_mod
from tests.e2e import kyverno, signed_image
from tests.e2e.cluster import LOGS
from tests.e2e.conftest import start_cluster
from tests.e2e.image import dpkg_records, expected_distributions, sbom_packages
from tests.e2e.registry import FileEntry, Registry, write_layer
from tests.helpers import EXAMPLES, NOW_TEXT, ROOT, review

ELF_MACHINES = {62: "x86-64", 183: "aarch64", 3: "i386", 40: "arm"}  # ELF e_machine values
EXAMPLES_IN_IMAGE = "/examples"
POLICY_SECTION = "### Enforcing it: a Kyverno `verifyImages` policy"  # in docs/install.md
POLICY_NAMESPACE = "dispatch-system"  # the webhook's namespace, as the docs' policy names it


@dataclass
class Signed:
    registry: Registry
    built: signed_image.MultiArch
    cosign: signed_image.Cosign
    sboms: dict[str, dict]  # platform -> syft's SBOM of that image, as attested
    arm64_rootfs: Path
    arm64_config: dict
    tmp: Path


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = Registry.start(tmp_path_factory.mktemp("signed-registry"))
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def signed(registry, tmp_path_factory):
    """The two-platform image built, pushed, signed with a new key, its SBOMs attested; the arm64 image's
    file system exported."""
    tmp = tmp_path_factory.mktemp("signed")
    built = signed_image.build_multiarch_image(registry)
    cosign = signed_image.Cosign.with_new_key(tmp / "cosign")
    sboms = signed_image.sign_with_sboms(cosign, built, tmp)
    arm64 = built.images["linux/arm64"]
    rootfs = image_mod.export_rootfs(registry, arm64, tmp / "arm64-rootfs")
    yield Signed(registry, built, cosign, sboms, rootfs, registry.config(arm64), tmp)
    shutil.rmtree(rootfs, ignore_errors=True)


def digest(ref: str) -> str:
    return ref.split("@")[1]


# ---- one index, two platforms, no emulation ----

def test_one_oci_index_of_linux_amd64_and_linux_arm64(signed):
    index = signed.registry.manifest(signed.built.ref)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert sorted(signed.built.images) == sorted(signed_image.PLATFORMS)
    for platform, ref in signed.built.images.items():
        config = signed.registry.config(ref)
        assert f"{config['os']}/{config['architecture']}" == platform
        # Each image keeps BuildKit's provenance beside it, as the amd64-only build does.
        assert image_mod.attestation_descriptor(index, digest(ref))["platform"]["os"] == "unknown"
    assert len(index["manifests"]) == 2 * len(signed_image.PLATFORMS)


def test_built_with_no_emulation(signed):
    # The worker that built the arm64 image cannot run an arm64 program, and nothing on this machine could
    # have run one for it: so no step of the build ran on the target.
    assert "linux/arm64" not in signed.built.worker_platforms
    assert "linux/amd64" in signed.built.worker_platforms
    assert signed_image.binfmt_handlers() == []
    print("build figures (s):", json.dumps({k: round(v) for k, v in image_mod.TIMINGS.items()}))


def test_the_amd64_half_is_the_image_the_node_runs(signed):
    """The amd64-only build (what build_webhook_image gives the node tests) and the multi-platform one give
    the same amd64 image, so the signature covers what the node runs."""
    node_index = signed.registry.manifest(image_mod.build_webhook_image(signed.registry))
    assert image_mod.image_descriptor(node_index)["digest"] == digest(signed.built.images["linux/amd64"])


def elf_machines(rootfs: Path) -> dict[str, list[str]]:
    """CPU -> paths (inside the image) of every ELF file in `rootfs`, from its header's e_machine."""
    found: dict[str, list[str]] = {}
    for path in sorted(rootfs.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        with open(path, "rb") as f:
            head = f.read(20)
        if len(head) == 20 and head[:4] == b"\x7fELF":
            machine = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
            found.setdefault(ELF_MACHINES.get(machine, str(machine)), []).append("/" + str(path.relative_to(rootfs)))
    return found


def test_every_program_and_library_of_the_arm64_image_is_aarch64(signed):
    machines = elf_machines(signed.arm64_rootfs)
    assert list(machines) == ["aarch64"], {cpu: paths[:5] for cpu, paths in machines.items()}
    aarch64 = machines["aarch64"]
    assert "/usr/bin/python3.13" in aarch64
    # The venv's compiled extensions are the aarch64 wheels' (pydantic-core, cryptography, ...).
    venv = [p for p in aarch64 if p.startswith("/opt/venv/")]
    assert any("pydantic_core" in p for p in venv) and any("cryptography" in p for p in venv)
    assert all("x86_64" not in p for p in aarch64)


def test_the_arm64_image_has_the_same_debian_packages_and_distributions(signed):
    records = dpkg_records(signed.arm64_rootfs)
    amd64_debian = sbom_packages(signed.sboms["linux/amd64"], "deb")
    assert records == amd64_debian  # the same packages at the same versions, for the other CPU
    for name in records:
        fields = (signed.arm64_rootfs / "var/lib/dpkg/status.d" / name).read_text()
        assert fields.count("\nArchitecture: ") == 1 and ("\nArchitecture: arm64\n" in fields
                                                          or "\nArchitecture: all\n" in fields), name
    got = signed_image.run_emulated(signed.arm64_rootfs, signed.arm64_config, [
        "/opt/venv/bin/python", "-c", "import importlib.metadata as m, json, platform; print(json.dumps("
        "[platform.machine(), sorted((d.metadata['Name'], d.version) for d in m.distributions())]))"])
    assert got.returncode == 0, got.stderr
    machine, installed = json.loads(got.stdout)
    assert machine == "aarch64"
    assert {canonicalize_name(n): v for n, v in installed} == expected_distributions()


# ---- the arm64 image at work, under qemu-user ----

def host_review(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    """The same `dispatch-admission review` on this machine, from the worktree's package."""
    return subprocess.run([sys.executable, "-m", "webhook", "review", *args], input=stdin, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("example", ["admitted-torch.yaml", "refused-several-reasons.yaml"])
def test_the_arm64_image_reviews_an_admission_review_under_qemu(signed, example):
    """`dispatch-admission review` of the arm64 image, run by qemu-aarch64 in the container, answers an
    AdmissionReview of an example TrainJob exactly as the same command does here."""
    doc = json.dumps(review(yaml.safe_load((EXAMPLES / "trainjobs" / example).read_text())))
    runtimes = sorted(p.relative_to(EXAMPLES) for p in (EXAMPLES / "runtimes").glob("*.yaml"))

    def args(base: str) -> list[str]:
        return ["--settings", f"{base}/settings/route1.json",
                *(a for r in runtimes for a in ("--runtime", f"{base}/{r}")), "--now", NOW_TEXT]

    started = time.monotonic()
    got = signed_image.run_emulated(signed.arm64_rootfs, signed.arm64_config,
                                    ["/opt/venv/bin/python", "/opt/venv/bin/dispatch-admission", "review",
                                     *args(EXAMPLES_IN_IMAGE)], mounts={EXAMPLES_IN_IMAGE: EXAMPLES}, stdin=doc)
    image_mod.TIMINGS[f"arm64 review under qemu ({example})"] = time.monotonic() - started
    assert got.returncode == 0, got.stderr
    expected = host_review(args(str(EXAMPLES)), doc)
    assert expected.returncode == 0, expected.stderr
    assert got.stdout == expected.stdout
    answer = json.loads(got.stdout)["response"]
    assert answer["allowed"] is example.startswith("admitted")
    print(f"arm64 under qemu, {example}: allowed={answer['allowed']}",
          answer.get("status", {}).get("message", "") or f"patch of {len(base64.b64decode(answer['patch']))} bytes")


# ---- the SBOMs ----

def deb_arches(sbom: dict) -> dict[str, str]:
    """Debian package -> the `arch` qualifier of its package URL, in a CycloneDX SBOM."""
    return {c["name"]: c["purl"].split("arch=")[1].split("&")[0]
            for c in sbom["components"] if c.get("purl", "").startswith("pkg:deb/")}


def test_the_arm64_sbom_lists_aarch64_packages(signed):
    sbom = signed.sboms["linux/arm64"]
    arches = deb_arches(sbom)
    assert set(arches.values()) == {"arm64", "all"}
    for name in ("libc6", "python3.13-minimal", "libpython3.13-stdlib", "libssl3t64"):
        assert arches[name] == "arm64", name
    assert sbom_packages(sbom, "pypi") == expected_distributions()
    # amd64's names the same packages for its CPU.
    amd64 = deb_arches(signed.sboms["linux/amd64"])
    assert amd64.keys() == arches.keys() and set(amd64.values()) == {"amd64", "all"}


# ---- cosign ----

def verified_digests(result: subprocess.CompletedProcess) -> list[str]:
    """The image digests a passing `cosign verify` printed (one JSON array of signed payloads)."""
    return [p["critical"]["image"]["docker-manifest-digest"] for p in json.loads(result.stdout)]


def test_cosign_verify_passes_for_the_index_and_both_images(signed):
    for ref in [signed.built.ref, *signed.built.images.values()]:
        got = signed.cosign.verify(ref)
        assert got.returncode == 0, got.stderr
        assert "The signatures were verified against the specified public key" in got.stderr
        assert verified_digests(got) == [digest(ref)]
        print(f"$ cosign verify --key cosign.pub {ref}\n{got.stderr.strip()}\n{got.stdout.strip()}")


def test_each_image_has_its_sbom_as_a_signed_attestation(signed):
    for platform, ref in signed.built.images.items():
        got = signed.cosign.verify_attestation(ref)
        assert got.returncode == 0, got.stderr
        envelopes = [json.loads(line) for line in got.stdout.splitlines() if line.strip()]
        assert len(envelopes) == 1
        statement = json.loads(base64.b64decode(envelopes[0]["payload"]))
        assert statement["predicateType"] == "https://cyclonedx.org/bom"
        assert [s["digest"]["sha256"] for s in statement["subject"]] == [digest(ref).split(":")[1]]
        assert statement["predicate"] == signed.sboms[platform]


def signed_copy(signed: Signed, tag: str) -> str:
    """The signed index under another tag, as a user would pull it: `HOST/dispatch-admission:TAG`."""
    ref = f"{signed.registry.host}/{image_mod.REPO}:{tag}"
    signed.registry.crane_run("tag", signed.built.ref, tag)
    return ref


@pytest.mark.parametrize("change", ["config", "layer"])
def test_a_tampered_image_fails_verification(signed, change):
    """The arm64 image changed (a label in its config, or a file in a new layer) and pushed, in a new index
    with the amd64 image, under the tag that held the signed one: verification of the tag fails, and of the
    changed image by its digest too, while the untouched amd64 image still passes."""
    tag = f"release-{change}"
    ref = signed_copy(signed, tag)
    assert signed.cosign.verify(ref).returncode == 0
    arm64 = signed.built.images["linux/arm64"]
    changed = f"{signed.registry.host}/{image_mod.REPO}:tampered-{change}"
    if change == "config":
        signed.registry.crane_run("mutate", arm64, "--label", "tampered=yes", "-t", changed)
    else:
        layer = write_layer(signed.tmp / "tamper.tar",
                            {"opt/venv/bin/extra": FileEntry(data=b"#!/bin/sh\n", mode=0o755)})
        signed.registry.crane_run("append", "-b", arm64, "-f", str(layer), "-t", changed)
    changed = signed.registry.digest_ref(changed)
    assert signed.registry.config(changed)["architecture"] == "arm64"
    signed.registry.push_index(image_mod.REPO, [signed.built.images["linux/amd64"], changed], tag=tag)
    assert signed.registry.digest_ref(ref) != signed.built.ref
    for target in (ref, changed):
        got = signed.cosign.verify(target)
        assert got.returncode != 0, got.stdout
        assert "no signatures found" in got.stderr or "no matching signatures" in got.stderr, got.stderr
    assert signed.cosign.verify(signed.built.images["linux/amd64"]).returncode == 0


def test_an_unsigned_image_or_another_key_fails_verification(signed):
    # The runtime base, also an index of both platforms, was never signed.
    unsigned = signed_image.push_runtime_bases(signed.registry)
    got = signed.cosign.verify(unsigned)
    assert got.returncode != 0 and "no signatures found" in got.stderr, got.stderr
    # Signed, but by a key this public key is not: refused.
    other = signed_image.Cosign.with_new_key(signed.tmp / "other-key")
    got = signed.cosign.verify(signed.built.ref, key=other.public_key)
    assert got.returncode != 0, got.stdout
    assert "no matching signatures" in got.stderr, got.stderr



# ---- enforcing it: the docs' Kyverno policy ----

def docs_policy(host: str, public_key: Path) -> dict:
    """The verifyImages ClusterPolicy docs/install.md shows, with this registry and the test's public key in
    place of its two placeholders."""
    section = (ROOT / "docs" / "install.md").read_text().split(POLICY_SECTION, 1)[1]
    policy = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    verify = policy["spec"]["rules"][0]["verifyImages"][0]
    assert verify["imageReferences"] == ["REGISTRY/dispatch-admission*"]
    verify["imageReferences"] = [f"{host}/{image_mod.REPO}*"]
    keys = verify["attestors"][0]["entries"][0]["keys"]
    assert "(the contents of cosign.pub)" in keys["publicKeys"]
    keys["publicKeys"] = public_key.read_text().strip()
    return policy


@pytest.fixture(scope="module")
def enforced(signed, tmp_path_factory):
    """An API server with Kyverno's admission controller (out of cluster, tests/e2e/kyverno.py) enforcing the
    docs' policy on the webhook's namespace."""
    tmp = tmp_path_factory.mktemp("verify-images")
    with contextlib.ExitStack() as stack:
        cluster = start_cluster(stack, tmp, [], suffix=" (verifyImages)")
        kyverno.install(cluster)
        cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": POLICY_NAMESPACE, "labels": {kyverno.ENGINE_LABEL: "kyverno"}}})
        # No controller manager runs to make the namespace's default ServiceAccount, which a pod needs.
        cluster.apply({"apiVersion": "v1", "kind": "ServiceAccount",
                       "metadata": {"name": "default", "namespace": POLICY_NAMESPACE}})
        policy = docs_policy(signed.registry.host, signed.cosign.public_key)
        kyv = stack.enter_context(kyverno.running(cluster, tmp, policies=[policy], resource="pods"))
        LOGS["kyverno (verifyImages)"] = kyv.log
        yield cluster


def webhook_pod(name: str, image: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": POLICY_NAMESPACE},
            "spec": {"containers": [{"name": "webhook", "image": image}]}}


def test_kyverno_admits_the_signed_image_and_refuses_the_others(signed, enforced):
    """The policy of docs/install.md, with the public key: a pod of the signed image by its tag is admitted
    and pinned to the digest Kyverno verified; a pod of a changed copy of it (unsigned) or of an image
    signed by another key is refused."""
    host = signed.registry.host
    got = enforced.apply(webhook_pod("signed", f"{host}/{image_mod.REPO}:{signed_image.TAG}"), check=False)
    assert got.returncode == 0, got.stderr
    image = enforced.get("pod", "signed", POLICY_NAMESPACE)["spec"]["containers"][0]["image"]
    assert image.endswith("@" + digest(signed.built.ref)), image
    print(f"kyverno admitted {signed_image.TAG}, pinned to {image}")

    # Changed copies of the signed amd64 image in the same repository: one never signed, one signed by a key
    # the policy does not hold.
    amd64 = signed.built.images["linux/amd64"]
    unsigned, by_other_key = f"{host}/{image_mod.REPO}:unsigned", f"{host}/{image_mod.REPO}:other-key"
    signed.registry.crane_run("mutate", amd64, "--label", "changed=yes", "-t", unsigned)
    signed.registry.crane_run("mutate", amd64, "--label", "signer=other", "-t", by_other_key)
    signed_image.Cosign.with_new_key(signed.tmp / "kyverno-other-key").sign(signed.registry.digest_ref(by_other_key))
    for name, ref in (("unsigned", unsigned), ("other-key", by_other_key)):
        got = enforced.apply(webhook_pod(name, ref), check=False)
        assert got.returncode != 0, f"{name}: admitted"
        assert "dispatch-admission-signed" in got.stderr and "signed-by-the-project" in got.stderr, got.stderr
        assert enforced.get("pod", name, POLICY_NAMESPACE) is None
        print(f"kyverno refused {name}: {got.stderr.strip()[-300:]}")
