"""SPEC 8: enforcement modes for every rule family, the audit's verdicts, and the runtime warnings."""

import copy
import io
import json

import pytest
import yaml

from tests.helpers import (
    CREDS,
    EXAMPLES,
    MANAGER,
    NOW,
    ROUTE1,
    ROUTE2,
    Faulty,
    mount_patch,
    mutated,
    pod_patch,
    review,
    runtime,
    settings,
    trainjob,
)
from webhook import api
from webhook.commands.audit import Report
from webhook.core.admission import Admission, Enforcement
from webhook.core.runtimes import RuntimeIndex, RuntimeUnavailable
from webhook.inspection.audit import CredentialSecrets, Verdict, judge_runtime, judge_trainjob
from webhook.kube.audit_reads import existing_secrets


def runtimes() -> RuntimeIndex:
    return RuntimeIndex(runtime_objects().values())


def runtime_objects() -> dict[str, dict]:
    """The runtime objects by name (as a runtime review carries them)."""
    found = [d for f in sorted((EXAMPLES / "runtimes").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    extra = [
        runtime("no-node", jobs={"worker": {"containers": [{"name": "trainer"}]}}),
        runtime("no-init"),
        runtime("mounts-publish", jobs={"node": {"containers": [
            {"name": "node", "volumeMounts": [{"name": "x", "mountPath": "/opt/dispatch"}]}]}}),
        runtime("plain", torch=False),
    ]
    return {r["metadata"]["name"]: r for r in found + extra}


def adm(doc=None, source=None, mode=Enforcement.ENFORCE) -> Admission:
    return Admission(settings(doc if doc is not None else {**ROUTE1, **CREDS}), source or runtimes(),
                     clock=lambda: NOW, enforcement=mode)


def with_entry(job: dict) -> dict:
    """The job plus the entry the webhook computes for it (so S5 stays out of the way)."""
    clean = trainjob(runtime_name=job["spec"]["runtimeRef"]["name"])
    own = next(e for e in mutated(adm(), clean)["spec"]["runtimePatches"] if e["manager"] == MANAGER)
    job = copy.deepcopy(job)
    job["spec"].setdefault("runtimePatches", []).append(own)
    return job


def keep_changed():
    genuine = mutated(adm(), trainjob(suspend=True))
    edited = copy.deepcopy(genuine)
    edited["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] = False
    return edited, genuine


# rule -> (settings or None, runtime source or None, object, old object or None, endpoints where enforce denies it)
CASES = {
    "S1": (None, None,
           trainjob(patches=[pod_patch("a.io/x", {"volumes": [{"name": "dispatch-publish", "emptyDir": {}}]})]),
           None, ("mutate", "validate")),
    "S2": (None, None, trainjob(patches=[mount_patch("/opt//dispatch/x")]), None, ("mutate", "validate")),
    "S3": (None, None, trainjob(env=[{"name": "DISPATCH_X", "value": "1"}]), None, ("mutate", "validate")),
    "S4": (None, None, trainjob(patches=[{"manager": MANAGER}, {"manager": MANAGER}]), None, ("mutate", "validate")),
    "S5": (None, None, trainjob(), None, ("validate",)),
    "S6": (None, None, trainjob(patches=[mount_patch("/var/run/dispatch/creds/x")]), None, ("mutate", "validate")),
    "R1": (None, None, trainjob(kind="JobSet"), None, ("mutate", "validate")),
    "R2": (None, None, trainjob(runtime_name="missing"), None, ("mutate", "validate")),
    "R3": (None, None, trainjob(runtime_name="no-node"), None, ("mutate", "validate")),
    "R4": (ROUTE2, None, trainjob(runtime_name="no-init"), None, ("mutate", "validate")),
    "R5": (None, None, trainjob(runtime_name="mounts-publish"), None, ("mutate", "validate")),
    "R6": (None, None, trainjob(runtime_name="plain", numProcPerNode=2), None, ("mutate", "validate")),
    "R7": (None, None, trainjob(env=[{"name": "PET_NNODES", "value": "2"}]), None, ("mutate", "validate")),
    "R8": (None, None, trainjob(patches=[{"manager": f"m{i}.io/x"} for i in range(16)]), None, ("mutate",)),
    "update": (None, None, *keep_changed(), ("mutate", "validate")),
    "unavailable": (None, Faulty(RuntimeUnavailable("down")), trainjob(), None, ("mutate", "validate")),
    "internal": (None, Faulty(KeyError("bug")), trainjob(), None, ("mutate", "validate")),
}


def _case(rule, verb):
    doc, source, obj, old, denied_on = CASES[rule]
    if verb == "validate" and rule not in ("S4", "S5", "R8", "update") and old is None:
        obj = with_entry(obj) if rule not in ("R1", "R2", "R3", "R4", "R5", "unavailable", "internal") else obj
    kw = {"operation": "UPDATE" if old is not None else "CREATE", "old": old}
    return doc, source, obj, kw, verb in denied_on


PAIRS = [(rule, verb) for rule in CASES for verb in ("mutate", "validate") if verb in CASES[rule][4]]


@pytest.mark.parametrize("rule,verb", PAIRS)
def test_spec_8_1_enforce_denies_by_the_rule(rule, verb):
    doc, source, obj, kw, _ = _case(rule, verb)
    a = adm(doc, source)
    _, outcome = a.review(review(obj, **kw), verb)
    assert not outcome.allowed and rule in {r.rule for r in outcome.reasons}, outcome.reasons
    assert outcome.would_deny == ()


@pytest.mark.parametrize("rule,verb", PAIRS)
def test_spec_8_1_warn_admits_unchanged_and_tells(rule, verb):
    doc, source, obj, kw, _ = _case(rule, verb)
    enforced = adm(doc, source).review(review(obj, **kw), verb)[1]
    resp, outcome = adm(doc, source, Enforcement.WARN).review(review(obj, **kw), verb)
    answer = resp["response"]
    assert answer["allowed"] and "patch" not in answer and "status" not in answer
    told = [w for w in answer["warnings"] if w.startswith("would deny: ")]
    # SPEC 8.1: in warn, /validate does not blame a bypass (S5) for the entry /mutate left out on purpose.
    expected = [r for r in enforced.reasons if r.rule != "S5" or len(enforced.reasons) == 1]
    assert len(told) == len(expected)
    for reason, w in zip(expected, told, strict=True):
        field = reason.field.partition(".trainingRuntimeSpec")[0]
        assert w.startswith(f"would deny: {reason.sentinel.name}: {field}") and len(w) <= 120
    if verb == "validate":  # counted once per cause, on the validating endpoint only
        assert outcome.would_deny == tuple((r.sentinel.name, r.rule) for r in expected)
        assert rule in {r for _, r in outcome.would_deny}
    else:
        assert outcome.would_deny == ()


@pytest.mark.parametrize("doc", [{**ROUTE1, **CREDS}, ROUTE2])
def test_spec_8_1_warn_mutates_exactly_where_enforce_admits(doc):
    job = trainjob(runtime_name="torch-init") if doc is ROUTE2 else trainjob()
    enforce_answer = adm(doc).review(review(job), "mutate")[0]["response"]
    warn_answer = adm(doc, mode=Enforcement.WARN).review(review(job), "mutate")[0]["response"]
    assert enforce_answer["allowed"] and warn_answer == enforce_answer


def test_spec_8_1_warn_is_chosen_by_the_python_api_too():
    got = api.check(settings({**ROUTE1}), trainjob(runtime_name="missing"), runtimes(), enforcement="warn")
    assert got.allowed and any(w.startswith("would deny: ErrNotFound: spec.runtimeRef.name") for w in got.warnings)


# ---- SPEC 8.2: the audit's verdicts ----

def test_spec_8_2_runtime_verdicts():
    a = adm(ROUTE2)
    found = {f.name: f for f in (judge_runtime(a, rt) for rt in runtimes())}
    assert found["torch-init"].verdict is Verdict.OK
    assert found["no-node"].verdict is Verdict.CANNOT_CARRY and [r.rule for r in found["no-node"].causes] == ["R3"]
    assert found["no-init"].verdict is Verdict.CANNOT_CARRY and [r.rule for r in found["no-init"].causes] == ["R4"]
    assert [r.rule for r in found["mounts-publish"].causes] == ["R4", "R5"]


def test_spec_8_2_trainjob_verdicts():
    a = adm()
    good = mutated(a, trainjob(name="good"))
    stale = copy.deepcopy(good)
    stale["metadata"]["name"] = "stale"
    stale["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]["volumes"][0]["image"]["reference"] = "old/publish@sha256:" + "1" * 64
    cases = {
        "good": (good, Verdict.OK),
        "stale": (stale, Verdict.STALE_ENTRY),
        "no-entry": (trainjob(name="no-entry"), Verdict.NO_ENTRY),
        "bad": (with_entry(trainjob(name="bad", patches=[mount_patch("/opt/dispatch")])), Verdict.VIOLATION),
        "bad-runtime": (trainjob(name="bad-runtime", runtime_name="no-node"), Verdict.VIOLATION),
        "gone": (trainjob(name="gone", runtime_name="gone"), Verdict.RUNTIME_MISSING),
        "full": (trainjob(name="full", patches=[{"manager": f"m{i}.io/x"} for i in range(16)]), Verdict.VIOLATION),
    }
    for name, (obj, verdict) in cases.items():
        found = judge_trainjob(a, obj)
        assert (found.name, found.verdict) == (name, verdict), found
        assert bool(found.causes) == (verdict in (Verdict.VIOLATION, Verdict.RUNTIME_MISSING))
    assert judge_trainjob(adm({}), trainjob()).verdict is Verdict.OK  # nothing configured: no entry is right
    assert judge_trainjob(adm({}), good).verdict is Verdict.STALE_ENTRY


def test_spec_8_2_report_table_json_and_exit_codes():
    a = adm()
    findings = [judge_trainjob(a, mutated(a, trainjob(name="ok"))), judge_trainjob(a, trainjob(name="x"))]
    table = io.StringIO()
    report = Report("table", table)
    for f in findings:
        report.add(f)
    assert report.close() == 1
    assert table.getvalue().splitlines() == ["no-entry         TrainJob team-a/x", "2 objects: 1 ok, 1 no-entry"]
    out = io.StringIO()
    report = Report("json", out)
    report.add(findings[0])
    assert report.close() == 0
    assert json.loads(out.getvalue()) == [{"kind": "TrainJob", "namespace": "team-a", "name": "ok", "verdict": "ok",
                                           "causes": []}]
    empty = io.StringIO()
    assert Report("json", empty).close() == 0 and json.loads(empty.getvalue()) == []


def test_audit_lists_each_namespace_whose_trainjobs_mount_a_missing_credential_secret():
    """Issue 35: a TrainJob whose entry mounts a Secret absent from its namespace never starts; audit names the
    namespace, the Secret, and (some of) the TrainJobs."""
    a = adm()
    mounted = CredentialSecrets(MANAGER)
    for ns, count in (("team-a", 1), ("team-q", 7)):
        for i in range(count):
            mounted.add(mutated(a, trainjob(name=f"job-{i}", namespace=ns)))
    mounted.add(trainjob(name="no-entry", namespace="team-z"))  # mounts nothing
    assert mounted.secrets() == {"s3-credentials": {"team-a", "team-q"}}
    [finding] = mounted.missing({("team-a", "s3-credentials")})
    assert (finding.kind, finding.namespace, finding.name, finding.verdict) == ("Namespace", "", "team-q",
                                                                                Verdict.SECRET_MISSING)
    [cause] = finding.causes
    assert (cause.sentinel.name, cause.field) == ("ErrNotFound", "credentials[checkpoint-store].secret")
    assert cause.text == ("Secret 's3-credentials' not found in namespace team-q: 7 TrainJob(s) mount it (job-0, job-1,"
                          " job-2, job-3, job-4, ...); their pods wait for it and never start")
    assert mounted.missing({("team-a", "s3-credentials"), ("team-q", "s3-credentials")}) == []
    out = io.StringIO()
    report = Report("table", out)
    report.add(finding)
    assert report.close() == 1
    assert out.getvalue().splitlines() == [
        "secret-missing   Namespace team-q  ErrNotFound: credentials[checkpoint-store].secret: " + cause.text,
        "1 objects: 1 secret-missing"]


def test_audit_reads_only_the_secrets_metadata_by_name():
    calls = []

    class Core:
        def list_secret_for_all_namespaces(self, **kw):
            calls.append(kw)
            items = [{"metadata": {"namespace": "team-a", "name": "s3-credentials"}}] if "_continue" not in kw else \
                [{"metadata": {"namespace": "team-b", "name": "s3-credentials"}}]
            more = {} if "_continue" in kw else {"continue": "next"}
            return type("Response", (), {"data": json.dumps({"items": items, "metadata": more})})()

    got = existing_secrets(Core(), {"s3-credentials": {"team-a", "team-q"}}, None, 500)
    assert got == {("team-a", "s3-credentials"), ("team-b", "s3-credentials")}
    assert [c["field_selector"] for c in calls] == ["metadata.name=s3-credentials"] * 2
    assert calls[0]["_headers"] == {"Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"}


# ---- SPEC 8.3: runtime warnings ----

def runtime_review(obj, operation="CREATE", resource="clustertrainingruntimes"):
    doc = review(obj, operation=operation, resource=resource)
    doc["request"]["kind"]["kind"] = obj.get("kind", "ClusterTrainingRuntime") if isinstance(obj, dict) else "x"
    return doc


@pytest.mark.parametrize("name,doc,rules", [
    ("torch-init", ROUTE2, []), ("no-init", ROUTE2, ["R4"]), ("no-init", ROUTE1, []), ("no-node", ROUTE1, ["R3"]),
    ("mounts-publish", ROUTE1, ["R5"]), ("mounts-publish", ROUTE2, ["R4", "R5"]), ("no-node", {}, []),
])
def test_spec_8_3_runtime_warnings(name, doc, rules):
    rt = runtime_objects()[name]
    for operation in ("CREATE", "UPDATE"):
        answer = adm(doc).review(runtime_review(rt, operation), "runtimes")[0]["response"]
        assert answer["allowed"] is True and "status" not in answer and "patch" not in answer
        warnings = answer.get("warnings", [])
        assert [w.split(":")[0] for w in warnings] == rules
        assert all("TrainJobs on this runtime will be refused" in w and len(w) <= 120 for w in warnings)


def test_spec_8_3_namespaced_runtimes_and_other_requests():
    rt = runtime("no-node-ns", kind="TrainingRuntime", namespace="team-a", jobs={"w": {"containers": [{"name": "x"}]}})
    answer = adm().review(runtime_review(rt, resource="trainingruntimes"), "runtimes")[0]["response"]
    assert [w.split(":")[0] for w in answer["warnings"]] == ["R3"]
    bad = runtime_objects()["no-node"]
    for doc in (runtime_review(bad, "DELETE"), review(trainjob(patches=[mount_patch("/opt/dispatch")])),
                runtime_review(bad, resource="pods"), runtime_review("not an object")):
        assert adm().review(doc, "runtimes")[0]["response"] == {"uid": "uid-1", "allowed": True}


def test_spec_8_3_trainjob_paths_ignore_runtimes():
    bad = runtime_objects()["no-node"]
    for verb in ("mutate", "validate"):
        assert adm().review(runtime_review(bad), verb)[0]["response"] == {"uid": "uid-1", "allowed": True}


# ---- SPEC 6.4: a warning cut at 120 characters still says which job lacks what ----

LONG_RUNTIME = "a-runtime-with-a-name-as-long-as-kubernetes-allows-" + "x" * 150
LONG_JOB = "trainer-nodes-of-the-largest-kind-" + "y" * 29  # a DNS-1123 label of 63


def lacking_init(name=LONG_RUNTIME, job=LONG_JOB) -> dict:
    return runtime(name, jobs={job: {"containers": [{"name": "node"}]}})


@pytest.mark.parametrize("verb", ["mutate", "validate"])
def test_spec_6_4_a_would_deny_warning_says_what_to_change_first(verb):
    source = RuntimeIndex([lacking_init()])
    answer = adm(ROUTE2, source, Enforcement.WARN).review(review(trainjob(runtime_name=LONG_RUNTIME)), verb)[0]
    [told] = [w for w in answer["response"]["warnings"] if w.startswith("would deny: ")]
    assert len(told) <= 120
    assert "lacks init container 'dispatch-publish'" in told and "job 'trainer-node" in told, told
    assert told.startswith("would deny: ErrUnsupported: spec.runtimeRef: job 'trainer-"), told


def test_spec_6_4_a_runtime_warning_says_what_to_change_first():
    answer = adm(ROUTE2).review(runtime_review(lacking_init()), "runtimes")[0]["response"]
    [told] = answer["warnings"]
    assert len(told) <= 120 and told.startswith("R4: TrainJobs on this runtime will be refused: job 'trainer-")
    assert "lacks init container 'dispatch-publish'" in told, told


def test_spec_6_4_a_field_inside_an_entry_is_shortened_to_its_job():
    job = trainjob(patches=[mount_patch("/opt/dispatch/x")])
    answer = adm(mode=Enforcement.WARN).review(review(with_entry(job)), "validate")[0]["response"]
    [told] = [w for w in answer["warnings"] if w.startswith("would deny: ")]
    assert told.startswith("would deny: ErrInvalid: spec.runtimePatches[0]..replicatedJobs[0]..containers[0]"
                           ".volumeMounts[0].mountPath: '/opt/dis"), told


# ---- SPEC 8.1: in warn, no S5 blame for an entry the mutating endpoint left out on purpose ----

@pytest.mark.parametrize("job,rule",
                         [(trainjob(runtime_name="no-node"), "R3"), (trainjob(runtime_name="missing"), "R2"),
                                      (trainjob(patches=[{"manager": f"m{i}.io/x"} for i in range(16)]), "R8")])
def test_spec_8_1_warn_validate_gives_the_reasons_that_kept_the_entry_out(job, rule):
    a = adm(mode=Enforcement.WARN)
    mutate = a.review(review(job), "mutate")[0]["response"]
    assert "patch" not in mutate  # left out on purpose: enforce would deny it
    resp, outcome = a.review(review(job), "validate")
    told = resp["response"]["warnings"]
    assert [r for _, r in outcome.would_deny] == [rule], (told, outcome.would_deny)
    assert not any("bypassed" in w for w in told), told


def test_spec_8_1_warn_still_blames_a_real_bypass():
    resp, outcome = adm(mode=Enforcement.WARN).review(review(trainjob()), "validate")
    assert [r for _, r in outcome.would_deny] == ["S5"] and any("bypassed" in w for w in resp["response"]["warnings"])
