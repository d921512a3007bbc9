"""What SPEC says of the upstream corpus (tests/corpus.py) under each settings case: the reviewed table, and the
review of every subject through the webhook's Python-level path, as `dispatch-admission review` answers it.

The expectation never comes from the code under test: every subject is admitted unless the table below says
otherwise, each exception naming the subject (file, place, object), the sentinel, the field and the rule, and
why, quoting SPEC. A new example in a later Trainer module is therefore expected to be admitted until someone
reviews it. ISSUE_34 lists the expectations that follow SPEC's issue-34 changes (claim templates and node mounts in
R5, sshAuthMountPath, plugin paths in the settings): before them, each of these was admitted and check (d) showed the
harm.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime

from tests.corpus import RUNTIME_KINDS, Corpus, Subject, subjects
from tests.trainer_pods import added_by, build_pods, collisions_with, missing
from webhook.core import patch as patch_mod
from webhook.core.admission import MUTATE, RUNTIMES, VALIDATE, Admission
from webhook.core.errors import Denied
from webhook.core.rules import NODE_CONTAINER
from webhook.core.runtimes import PLURALS, RuntimeIndex
from webhook.core.settings import parse

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
IMAGE = ("registry.gitlab.com/phpboyscout/go/dispatch/publish@sha256:"
         "0f3c8a1d2b4e5f60718293a4b5c6d7e8f9012a3b4c5d6e7f8091a2b3c4d5e6f7")
MANAGER = "dispatch.go.phpboyscout.uk/publish"
ROUTE1 = {"manager": MANAGER, "publish": {"image": IMAGE, "via": "imageVolume"}, "credentials": [
    {"name": "checkpoint-store", "secret": "s3-credentials", "mountPath": "/var/run/dispatch/creds"}]}
ROUTE2 = {"manager": MANAGER, "publish": {"image": IMAGE, "via": "initContainer", "initContainer": "dispatch-publish"}}
COPIER = {"name": "dispatch-publish", "image": "registry.example/dispatch-publish-copier:1",
          "command": ["sh", "-c", 'cp /publish "$DISPATCH_PUBLISH_DEST/publish"']}


def credential(name: str = "checkpoint-store", path: str = "/var/run/dispatch/creds") -> dict:
    return {**ROUTE1, "credentials": [{"name": name, "secret": "s3-credentials", "mountPath": path}]}


@dataclass(frozen=True)
class Refused:
    sentinel: str
    field: str
    rule: str
    why: str = ""

    @property
    def reason(self) -> tuple[str, str, str]:
        return (self.sentinel, self.field, self.rule)


ADMITTED = None
TORCHTUNE = [f"manifests/base/runtimes/torchtune/{f} (doc 1) ClusterTrainingRuntime {n}" for f, n in
             (("llama3_2/llama3_2_1B.yaml", "torchtune-llama3.2-1b"),
              ("llama3_2/llama3_2_3B.yaml", "torchtune-llama3.2-3b"),
              ("qwen2_5/qwen2_5_1.5B.yaml", "torchtune-qwen2.5-1.5b"))]
MPI_RUNTIMES = [f"manifests/base/runtimes/{f} (doc 1) ClusterTrainingRuntime {n}" for f, n in
                (("deepspeed_distributed.yaml", "deepspeed-distributed"), ("mlx_distributed.yaml", "mlx-distributed"))]
R3 = ('R3: "Target jobs: every replicatedJob of the runtime template whose pod template has a container named'
      ' `node`. There must be at least one." (ErrUnsupported)')
NO_TARGET = Refused("ErrUnsupported", "spec.runtimeRef", "R3", R3)

# Refused under every settings case that runs the corpus: the runtime named is missing or has no target job.
UNUSABLE_RUNTIME = {
    "docs/operator-guides/runtime-patches.md (line 21) TrainJob default/pytorch-distributed": Refused(
        "ErrNotFound", "spec.runtimeRef.name", "R2",
        'R2: "The runtime must exist" (ErrNotFound): no ClusterTrainingRuntime pytorch-distributed-gpu in the corpus'),
    "docs/operator-guides/job-scheduling/kai.md (line 55) TrainJob default/pytorch-kai-job": Refused(
        *NO_TARGET.reason,
        R3 + ": pytorch-kai-runtime puts `containers` straight under template.spec, no replicatedJobs"),
    "probe of docs/operator-guides/job-scheduling/kai.md (line 33) ClusterTrainingRuntime pytorch-kai-runtime": Refused(
        *NO_TARGET.reason, R3 + ": template.spec has `containers` but no replicatedJobs"),
    "probe of pkg/runtime/core/snapshot_test.go (line 342) TrainingRuntime test-namespace/other-runtime": Refused(
        *NO_TARGET.reason, R3 + ": `replicatedJobs: []`"),
    "probe of pkg/runtime/core/snapshot_test.go (line 376) ClusterTrainingRuntime test-runtime": Refused(
        *NO_TARGET.reason, R3 + ": `replicatedJobs: []`"),
}

R5_CLAIM = ('R5: "The runtime template must not already define a volume ... named like a credential ... \'Define a'
            ' volume\' includes the JobSet template\'s `volumeClaimPolicies` claim templates" (ErrUnsupported): the'
            ' torchtune runtimes\' claim template is named `initializer`')
R5_MOUNT = ('R5: "... nor [mount anything] at or under a credential\'s `mountPath` in the `node` container of a target'
            ' job" (ErrUnsupported): the torchtune runtimes\' node container mounts /workspace')
R5_SSH = ('R5: "With `mlPolicy.mpi`, its `sshAuthMountPath` (default `/root/.ssh`) must not overlap a credential\'s'
          ' `mountPath`" (ErrUnsupported): the stock MPI runtimes set sshAuthMountPath /home/mpiuser/.ssh')
PLUGIN_PATHS = ('SPEC 2: "So is a mountPath that overlaps, the same way, a path that Trainer v2.3.0\'s plugins mount'
                ' into the pods after the runtimePatches are merged ... `/etc/mpi`, `/etc/flux-config`, `/curve`,'
                ' `/mnt/flux`, `/dev/shm`, `/opt/software`, `/var/run/secrets/kubeflow/trainer`" (ErrInvalid)')


@dataclass(frozen=True)
class Case:
    id: str
    settings: dict
    about: str
    exceptions: dict = field(default_factory=dict)  # subject id -> Refused
    default: Refused | None = ADMITTED                # what a subject not in `exceptions` gets
    route2_runtimes: bool = False  # each runtime given the init container in its target jobs (SPEC 2, R4)
    settings_refused: Refused | None = None           # the settings themselves are refused (SPEC 2)

    def expected(self, subject: Subject) -> Refused | None:
        return self.exceptions.get(subject.id, self.default)


CASES = [
    Case("example", ROUTE1, "route 1 with the credential checkpoint-store at /var/run/dispatch/creds (examples/"
         "settings/route1.json)", dict(UNUSABLE_RUNTIME)),
    Case("route2", ROUTE2, "route 2 (examples/settings/route2.json), each runtime given the init container"
         " dispatch-publish in every job with a node container, as SPEC 2 asks of the platform",
         dict(UNUSABLE_RUNTIME), route2_runtimes=True),
    Case("route2-as-shipped", ROUTE2, "route 2 on the runtimes as Trainer ships them", dict(UNUSABLE_RUNTIME),
         default=Refused("ErrUnsupported", "spec.runtimeRef", "R4",
                         'R4: "Route 2: every target job must define the init container named by'
                         ' publish.initContainer" (ErrUnsupported): no upstream runtime defines dispatch-publish')),
    Case("credential-initializer", credential(name="initializer"), "a credential named like the torchtune claim",
         {**UNUSABLE_RUNTIME, **{f"probe of {t}": Refused("ErrUnsupported", "spec.runtimeRef", "R5", R5_CLAIM)
                                 for t in TORCHTUNE}}),
    Case("credential-workspace", credential(path="/workspace"), "a credential at the torchtune runtimes' /workspace",
         {**UNUSABLE_RUNTIME, **{f"probe of {t}": Refused("ErrUnsupported", "spec.runtimeRef", "R5", R5_MOUNT)
                                 for t in TORCHTUNE}}),
    Case("credential-mpi-ssh", credential(path="/home/mpiuser/.ssh"), "a credential at the MPI runtimes' SSH keys",
         {**UNUSABLE_RUNTIME, **{f"probe of {t}": Refused("ErrUnsupported", "spec.runtimeRef", "R5", R5_SSH)
                                 for t in MPI_RUNTIMES}}),
    Case("credential-root-ssh", credential(path="/root/.ssh"), "a credential at the default sshAuthMountPath, which no"
         " corpus MPI runtime uses (they set /home/mpiuser/.ssh): admitted", dict(UNUSABLE_RUNTIME)),
    *(Case(f"credential-at-{path.strip('/').replace('/', '-')}", credential(path=path),
           f"a credential at {path}, which overlaps a Trainer plugin mount",
           settings_refused=Refused("ErrInvalid", "credentials[0].mountPath", "settings", PLUGIN_PATHS))
      for path in ("/etc/mpi", "/etc", "/dev/shm")),
]

# The expectations that fail until the core implements SPEC's issue-34 changes (for the lead to check after
# the merge): (case, subject id, or "settings" where the settings themselves are to be refused).
ISSUE_34 = [
    *(("credential-initializer", f"probe of {t}") for t in TORCHTUNE),
    *(("credential-workspace", f"probe of {t}") for t in TORCHTUNE),
    *(("credential-mpi-ssh", f"probe of {t}") for t in MPI_RUNTIMES),
    ("credential-at-etc-mpi", "settings"), ("credential-at-etc", "settings"), ("credential-at-dev-shm", "settings"),
]


def with_init_container(runtime: dict, init: dict = COPIER) -> dict:
    """The runtime with `init` in every replicated job whose pod has a `node` container (where absent)."""
    out = copy.deepcopy(runtime)
    for rj in ((out.get("spec") or {}).get("template") or {}).get("spec", {}).get("replicatedJobs") or []:
        pod = (((rj.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        if any(c.get("name") == NODE_CONTAINER for c in pod.get("containers") or []) and \
                not any(c.get("name") == init["name"] for c in pod.get("initContainers") or []):
            pod.setdefault("initContainers", []).append(copy.deepcopy(init))
    return out


def _review(obj: dict, resource: str = "trainjobs") -> dict:
    meta = obj["metadata"]
    kind = {v: k for k, v in PLURALS.items()}[resource]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "corpus", "kind": {"group": "trainer.kubeflow.org", "version": "v1alpha1", "kind": kind},
        "resource": {"group": "trainer.kubeflow.org", "version": "v1alpha1", "resource": resource},
        "name": meta.get("name", ""), "namespace": meta.get("namespace", ""), "operation": "CREATE",
        "object": obj}}


@dataclass
class Verdict:
    subject: Subject
    expected: Refused | None
    reasons: set = field(default_factory=set)   # (sentinel, field, rule) of the refusal; empty when admitted
    stored: dict | None = None                  # the object the API server would store (admitted)
    runtime: dict | None = None                 # the runtime the subject names, as the cluster holds it
    problems: list[str] = field(default_factory=list)  # what broke: (a), the runtime warnings, (d)

    @property
    def admitted(self) -> bool:
        return not self.reasons

    def outcome(self) -> str:
        if self.admitted:
            return "admitted"
        return "; ".join(f"{s} {f} ({r})" for s, f, r in sorted(self.reasons))


def _runtimes(case: Case, subject: Subject) -> list[dict]:
    return [with_init_container(d.obj) if case.route2_runtimes else d.obj for d in subject.cluster]


def judge(case: Case, subject: Subject) -> Verdict:
    """(a) and (d) for one subject: mutate, then validate what the mutation made, as the API server chains them."""
    settings = parse(json.dumps(case.settings))
    admission = Admission(settings, RuntimeIndex(_runtimes(case, subject)), clock=lambda: NOW)
    expected = case.expected(subject)
    v = Verdict(subject, expected)
    named = subject.runtime()
    if named is not None:
        v.runtime = with_init_container(named.obj) if case.route2_runtimes else named.obj
    answer, outcome = admission.review(_review(copy.deepcopy(subject.trainjob)), MUTATE)
    v.reasons = {(r.sentinel.label, r.field, r.rule) for r in outcome.reasons}
    if answer["response"]["allowed"]:
        v.stored = patch_mod.apply(subject.trainjob, outcome.ops)
        _, checked = admission.review(_review(copy.deepcopy(v.stored)), VALIDATE)
        if checked.reasons:
            v.problems.append(f"/validate refuses what /mutate made: {[str(r) for r in checked.reasons]}")
    want = set() if expected is None else {expected.reason}
    if v.reasons != want:
        v.problems.append(f"(a) expected {'admitted' if expected is None else expected.reason}, got {v.outcome()}")
    if subject.probe:  # SPEC 8.3: /runtimes warns for each R3, R4 or R5 reason a TrainJob on it would get
        obj = with_init_container(subject.doc.obj) if case.route2_runtimes else subject.doc.obj
        answer, _ = admission.review(_review(copy.deepcopy(obj), PLURALS[subject.doc.kind]), RUNTIMES)
        warned = {w.split(":")[0] for w in answer["response"].get("warnings") or []}
        if warned != {r for _, _, r in want if r in ("R3", "R4", "R5")}:
            v.problems.append(f"/runtimes warns for {sorted(warned) or 'nothing'}")
    if v.stored is not None and v.runtime is not None:  # (d)
        pods = build_pods(v.runtime, v.stored)
        met = collisions_with(pods, f"patch {settings.manager}")
        v.problems += [f"(c) {a}" for a in added_by(pods, f"patch {settings.manager}")]
        v.problems += [f"(d) {c}" for c in met]
        v.problems += [f"(d) {p.job}: two of {d}" for p in pods.values() for d in p.duplicates()]
        entry = next(e for e in v.stored["spec"]["runtimePatches"] if e.get("manager") == settings.manager)
        if not met:  # the entry reached the pods (else (d) would hold of a merge that dropped it)
            v.problems += [f"(d) not in the pods: {m}" for m in missing(pods, entry)]
    return v


def settings_outcome(case: Case) -> set:
    """(sentinel, field, rule) of the settings' refusal, empty when they parse."""
    try:
        parse(json.dumps(case.settings))
    except Denied as e:
        return {(r.sentinel.label, r.field, "settings") for r in e.reasons}
    return set()


def run(case: Case, corpus: Corpus) -> list[Verdict]:
    return [judge(case, s) for s in subjects(corpus)]


def report(corpus: Corpus) -> None:
    """Every file read and the outcome of its objects under each case (`python -m tests.corpus`)."""
    runnable = [c for c in CASES if c.settings_refused is None]
    results = {c.id: {v.subject.id: v for v in run(c, corpus)} for c in runnable}
    for c in CASES:
        print(f"{c.id}: {c.about}")
    for source in corpus.read:
        print(f"\n{source}")
        for s in (s for s in subjects(corpus) if s.doc.source == source):
            print(f"  {'probe of ' if s.probe else ''}{s.doc.object} ({s.doc.where})")
            for c in runnable:
                v = results[c.id][s.id]
                mark = "ok" if not v.problems else "FAILS: " + "; ".join(v.problems)
                print(f"    {c.id}: {v.outcome()} [{mark}]")
    for c in CASES:
        if c.settings_refused is not None:
            got = settings_outcome(c)
            ok = got == {c.settings_refused.reason}
            mark = "ok" if ok else "FAILS"
            print(f"{c.id}: settings {sorted(got) or 'accepted'} [{mark}]")


__all__ = ["CASES", "ISSUE_34", "Case", "Refused", "Verdict", "judge", "run", "settings_outcome",
           "with_init_container", "RUNTIME_KINDS"]
