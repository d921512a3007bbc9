"""The same TrainJobs through our webhook and through another engine on one API server: Kyverno's policies
(bench/kyverno) or the in-tree admission policies, a ValidatingAdmissionPolicy and a MutatingAdmissionPolicy
(bench/cel).

Each engine owns a namespace (ENGINE_LABEL selects it in every engine's webhook configurations or policy
bindings); every case is sent to both, as a create or as an update of an object the same engine admitted (or,
for jobs "created before the webhook", one stored while its namespace was out of scope). The answers compared:
allowed or refused, and for an admitted object the publish entry it ends with (`time` aside) and its position.

The cases come from the rule tests (tests/unit/test_rules.py, test_hardening.py, test_updates.py) and the
bypass catalogue (tests/bypass.py); each carries what SPEC says of it (allow or deny) and where it is from.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import yaml

from tests import bypass
from tests.e2e import kyverno
from tests.e2e.cluster import LOGS
from tests.e2e.kyverno import ENGINE_LABEL, SKIP_MUTATION_LABEL
from tests.e2e.webhooks import Webhook
from tests.helpers import EXAMPLES, MANAGER, mount_patch, mutated, pod_patch, runtime, stock_runtimes, trainjob
from tests.process import eventually, webhook_server
from webhook.core.admission import Admission

ENGINES = ("ours", "kyverno", "cel")
NAMESPACES = {"ours": "fid-ours", "kyverno": "fid-kyverno", "cel": "fid-cel"}
LABELS = {"kyverno": "Kyverno", "cel": "VAP/MAP"}
GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
KUEUE = "kueue.x-k8s.io/manager"
TORCH_RESERVED = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def our_settings():
    from webhook.commands.files import load_settings

    return load_settings(str(EXAMPLES / "settings" / "route1.json"))


def extra_runtimes() -> list[dict]:
    """ClusterTrainingRuntimes the rule tests build, beside the examples'."""
    jax = runtime(name="fid-jax", torch=False)
    jax["spec"]["mlPolicy"]["jax"] = {}
    return [
        runtime(name="fid-r5-volume", jobs={"node": {"volumes": [{"name": "dispatch-publish", "emptyDir": {}}],
                                                     "containers": [{"name": "node", "image": "pytorch"}]}}),
        runtime(name="fid-r5-credential", jobs={"node": {"volumes": [{"name": "checkpoint-store", "emptyDir": {}}],
                                                         "containers": [{"name": "node", "image": "pytorch"}]}}),
        runtime(name="fid-r5-init-mount", jobs={"node": {
            "containers": [{"name": "node", "image": "pytorch"}],
            "initContainers": [{"name": "i", "image": "busybox",
                                "volumeMounts": [{"name": "v", "mountPath": "//opt/dispatch/x/"}]}],
            "volumes": [{"name": "v", "emptyDir": {}}]}}),
        runtime(name="fid-r5-other-job", jobs={
            "node": {"containers": [{"name": "node", "image": "pytorch"}]},
            "init": {"containers": [{"name": "x", "image": "busybox",
                                     "volumeMounts": [{"name": "v", "mountPath": "/opt/dispatch"}]}],
                     "volumes": [{"name": "v", "emptyDir": {}}]}}),
        runtime(name="fid-plain", torch=False),
        jax,
    ]


def namespaced_runtimes(namespace: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "runtimes" / "team-a.yaml").read_text()) if d]
    for d in docs:
        d["metadata"]["namespace"] = namespace
    return docs


@dataclass
class Case:
    id: str
    source: str
    job: dict                                   # the object created (CREATE), or the old object (UPDATE)
    expect: str                                 # what SPEC says of the request under test: allow | deny
    update: Callable[[dict], dict] | None = None  # stored old object -> the object sent as an UPDATE
    pre_webhook: bool = False                   # the old object is stored with its namespace out of scope
    own_runtime: bool = False                   # a ClusterTrainingRuntime named by runtimeRef is made just before
    before_update: Callable[..., None] | None = None  # (cluster, engine) -> None, between the create and the update
    labels: dict = field(default_factory=dict)

    @property
    def operation(self) -> str:
        return "UPDATE" if self.update else "CREATE"


@dataclass
class Outcome:
    allowed: bool
    message: str = ""
    entry: dict | None = None   # the publish entry of the stored object, `time` left out
    index: int | None = None
    code: int = 0               # the HTTP status of a refusal

    def summary(self) -> str:
        if not self.allowed:
            return f"refused ({self.code}): " + self.message
        where = "no entry" if self.entry is None else f"entry at {self.index}"
        return f"admitted, {where}"


def agree(a: Outcome, b: Outcome) -> bool:
    return a.allowed == b.allowed and (not a.allowed or (a.entry == b.entry and a.index == b.index))


def _own(obj: dict) -> tuple[dict | None, int | None]:
    for i, e in enumerate((obj.get("spec") or {}).get("runtimePatches") or []):
        if e.get("manager") == MANAGER:
            return {k: v for k, v in e.items() if k != "time"}, i
    return None, None


# ---- the cases ----


def _set(job: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    cur = job
    for p in parents:
        cur = cur.setdefault(p, {})
    cur[last] = value
    return job


def _own_pod(obj: dict) -> dict:
    own = next(e for e in obj["spec"]["runtimePatches"] if e["manager"] == MANAGER)
    return own["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _kueue(filled: bool = False) -> dict:
    spec: dict = {}
    if filled:
        spec = {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
            "metadata": {"labels": {"kueue.x-k8s.io/queue-name": "lq"}},
            "spec": {"nodeSelector": {"pool": "a"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}}}}}]}
    return {"manager": KUEUE, "trainingRuntimeSpec": {"template": {"spec": spec}}}


def _edit(fn: Callable[[dict], None]) -> Callable[[dict], dict]:
    def update(obj: dict) -> dict:
        fn(obj)
        return obj
    return update


def _runtime_doc(name: str) -> dict:
    rt = runtime(name=name)
    rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "image"] = "pytorch"
    return rt


def _delete_runtime(cluster, engine: str) -> None:
    cluster.kubectl("delete", "clustertrainingruntime", f"fid-gone-{engine}")


def cases() -> list[Case]:
    out: list[Case] = []
    adm = Admission(our_settings(), stock_runtimes())

    def computed(job: dict) -> dict:
        return mutated(adm, job)

    # The bypass catalogue's creates: every trick refused; a forged entry alone is replaced by the
    # mutation (SPEC 6.2), so through the API server it is admitted with the computed entry.
    for name, op, obj, _old, rule in bypass.cases(computed):
        if op != "CREATE":
            continue
        replaced = rule == "S4" and "two entries" not in name
        out.append(Case(f"bypass {rule}: {name}", "tests/bypass.py", obj, "allow" if replaced else "deny"))

    def add(case_id, source, job, expect, **kw):
        out.append(Case(case_id, source, job, expect, **kw))

    rules, hardening, updates = "tests/unit/test_rules.py", "tests/unit/test_hardening.py", "tests/unit/test_updates.py"
    add("plain TrainJob on torch-distributed", rules, trainjob(), "allow")
    add("two target jobs (mpi-launcher)", rules, trainjob(runtime_name="mpi-launcher"), "allow")
    add("TrainingRuntime in the job's namespace", rules, trainjob(runtime_name="plain", kind="TrainingRuntime"),
        "allow")
    for p in ("/opt/dispatcher", "/opt", "/opt/Dispatch", "/data"):
        add(f"S2 neighbour {p} allowed (case-sensitive)", rules, trainjob(patches=[mount_patch(p)]), "allow")
    add("S6 sibling /var/run/dispatch/credsx allowed", hardening,
        trainjob(patches=[mount_patch("/var/run/dispatch/credsx")]), "allow")
    add("S3 similar names allowed", rules, trainjob(env=[{"name": "dispatch_x", "value": "1"},
                                                         {"name": "XDISPATCH_", "value": ""}]), "allow")
    for ref, what in (({"apiGroup": "kubeflow.org"}, "apiGroup kubeflow.org"), ({"kind": "JobSet"}, "kind JobSet"),
                      ({"apiGroup": ""}, "explicit empty apiGroup"), ({"kind": ""}, "explicit empty kind")):
        add(f"R1 {what}", rules, _set(trainjob(), "spec.runtimeRef", {"name": "torch-distributed", **ref}), "deny")
    add("R2 missing ClusterTrainingRuntime", rules, trainjob(runtime_name="does-not-exist"), "deny")
    add("R2 TrainingRuntime looked up in the job's namespace", rules,
        trainjob(runtime_name="torch-distributed", kind="TrainingRuntime"), "deny")
    add("R2 runtime created a moment before its job", "SPEC 7 (cache miss confirmed)",
        trainjob(runtime_name="fid-fresh-{engine}"), "allow", own_runtime=True)
    add("R3 no node container", rules, trainjob(runtime_name="no-node", kind="TrainingRuntime"), "deny")
    add("R5 runtime mounts under /opt/dispatch", rules,
        trainjob(runtime_name="self-mounting", kind="TrainingRuntime"), "deny")
    for rt in ("fid-r5-volume", "fid-r5-credential", "fid-r5-init-mount", "fid-r5-other-job"):
        add(f"R5 {rt}", rules, trainjob(runtime_name=rt), "deny")
    add("R6 numProcPerNode on a runtime without torch", rules,
        trainjob(runtime_name="plain", kind="TrainingRuntime", numProcPerNode=4), "deny")
    add("R6 numProcPerNode on jax", updates, trainjob(runtime_name="fid-jax", numProcPerNode=4), "deny")
    add("R6 numProcPerNode on mpi", hardening, trainjob(runtime_name="mpi-launcher", numProcPerNode=4), "allow")
    add("R6 numProcPerNode on torch", rules, trainjob(numProcPerNode=4), "allow")
    for name in TORCH_RESERVED:
        add(f"R7 {name} on torch", rules, trainjob(env=[{"name": name, "value": "1"}]), "deny")
    add("R7 PET_NNODES on a runtime without torch", rules,
        trainjob(runtime_name="fid-plain", env=[{"name": "PET_NNODES", "value": "1"}]), "allow")
    full = [{"manager": f"example.com/m{i}"} for i in range(16)]
    add("R8 16 other entries", rules, trainjob(patches=full), "deny")
    add("R8 15 other entries", rules, trainjob(patches=full[:15]), "allow")
    add("S4 pre-seeded correct entry replaced in place", rules,
        trainjob(patches=[{"manager": "example.com/first"}, *computed(trainjob())["spec"]["runtimePatches"],
                          {"manager": "example.com/last"}]), "allow")
    add("S5 mutation bypassed", rules, trainjob(), "deny", labels={SKIP_MUTATION_LABEL: "true"})

    # ---- updates (SPEC 6.3) ----
    queued = trainjob(suspend=True, patches=[_kueue()])
    add("U resume a suspended job", updates, trainjob(suspend=True), "allow",
        update=_edit(lambda o: _set(o, "spec.suspend", False)))
    add("U Kueue fills its entry", updates, queued, "allow",
        update=_edit(lambda o: o["spec"]["runtimePatches"].__setitem__(0, _kueue(True))))
    add("U Kueue clears its entry", updates, _set(copy.deepcopy(queued), "spec.runtimePatches", [_kueue(True)]),
        "allow", update=_edit(lambda o: o["spec"]["runtimePatches"].__setitem__(0, _kueue())))
    add("U metadata only", updates, trainjob(suspend=True), "allow",
        update=_edit(lambda o: o["metadata"].setdefault("labels", {}).update({"team": "a"})))
    add("U re-applied manifest drops the entry", updates, trainjob(suspend=True, patches=[_kueue()]), "allow",
        update=_edit(lambda o: _set(o, "spec.runtimePatches", [_kueue()])))
    add("U entry image changed", "tests/bypass.py", trainjob(suspend=True), "deny",
        update=_edit(lambda o: _own_pod(o)["volumes"][0]["image"].update(reference="evil.example/publish:latest")))
    add("U publish mount made writable", "tests/bypass.py", trainjob(suspend=True), "deny",
        update=_edit(lambda o: _own_pod(o)["containers"][0]["volumeMounts"][0].update(readOnly=False)))
    add("U mount under /opt/dispatch added", "tests/bypass.py", trainjob(suspend=True), "deny",
        update=_edit(lambda o: o["spec"]["runtimePatches"].insert(0, mount_patch("/opt/./dispatch//x"))))
    add("U suspend after the runtime was deleted", updates, trainjob(runtime_name="fid-gone-{engine}"), "allow",
        update=_edit(lambda o: _set(o, "spec.suspend", True)), own_runtime=True, before_update=_delete_runtime)
    add("U runtimeRef pointed at a missing runtime", updates, trainjob(suspend=True), "deny",
        update=_edit(lambda o: _set(o, "spec.runtimeRef.name", "missing")))
    add("U numProcPerNode added on jax", updates, trainjob(suspend=True, runtime_name="fid-jax"), "deny",
        update=_edit(lambda o: _set(o, "spec.trainer", {"numProcPerNode": 4})))
    add("U env added, runtime read, nothing new", updates, trainjob(suspend=True), "allow",
        update=_edit(lambda o: _set(o, "spec.trainer", {"env": [{"name": "LOG_LEVEL", "value": "debug"}]})))
    # Jobs stored before the webhook: what they already were never refuses an update; something new does.
    dispatch_env = trainjob(suspend=True, env=[{"name": "DISPATCH_X", "value": "1"}])
    add("U pre-webhook DISPATCH_ env, label added", hardening, dispatch_env, "allow", pre_webhook=True,
        update=_edit(lambda o: o["metadata"].setdefault("labels", {}).update({"team": "a"})))
    add("U pre-webhook DISPATCH_ env, resumed", updates, dispatch_env, "allow", pre_webhook=True,
        update=_edit(lambda o: _set(o, "spec.suspend", False)))
    add("U pre-webhook DISPATCH_ env, a second one added", updates, dispatch_env, "deny", pre_webhook=True,
        update=_edit(lambda o: o["spec"]["trainer"]["env"].insert(0, {"name": "DISPATCH_Y", "value": "2"})))
    add("U pre-webhook missing runtime, suspended", updates, trainjob(runtime_name="gone"), "allow",
        pre_webhook=True, update=_edit(lambda o: _set(o, "spec.suspend", True)))
    bad_mount = trainjob(suspend=True, patches=[mount_patch("/opt/dispatch/x", manager="a.io/x")])
    add("U pre-webhook bad entry moved by one put before it", updates, bad_mount, "allow", pre_webhook=True,
        update=_edit(lambda o: o["spec"]["runtimePatches"].insert(0, _kueue(True))))
    scratch = trainjob(suspend=True, patches=[mount_patch("/var/scratch")])
    add("U pre-webhook, a mount under /opt/dispatch added", updates, scratch, "deny", pre_webhook=True,
        update=_edit(lambda o: o["spec"]["runtimePatches"].append(mount_patch("/opt/./dispatch//x", manager="b.io/y"))))
    add("U pre-webhook Kueue resume, nothing added", updates, queued, "allow", pre_webhook=True,
        update=_edit(lambda o: _set(o, "spec.suspend", False)))
    add("U pre-webhook, the correct entry brought by a client", hardening, trainjob(suspend=True), "allow",
        pre_webhook=True, update=_edit(lambda o: _set(o, "spec.runtimePatches",
                                                       computed(trainjob())["spec"]["runtimePatches"])))
    add("U pre-webhook, a forged entry brought by a client", hardening, trainjob(suspend=True), "deny",
        pre_webhook=True, update=_edit(lambda o: _set(o, "spec.runtimePatches", [
            pod_patch(MANAGER, {"volumes": [{"name": "dispatch-publish", "emptyDir": {}}]})])))
    return out


# ---- running them ----


def _api(cluster):
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=cluster.kubeconfig, client_configuration=cfg)
    return client.CustomObjectsApi(client.ApiClient(cfg))


def _message(exc) -> str:
    try:
        return json.loads(exc.body).get("message", "")
    except (ValueError, TypeError, AttributeError):
        return str(exc)


def _prepared(case: Case, engine: str, name: str) -> dict:
    job = copy.deepcopy(case.job)
    job["metadata"] = {"name": name, "namespace": NAMESPACES[engine],
                       **({"labels": dict(case.labels)} if case.labels else {})}
    ref = job["spec"]["runtimeRef"]
    ref["name"] = ref["name"].format(engine=engine)
    return job


def _scope(cluster, custom, engine: str, on: bool) -> None:
    """Put an engine's namespace in or out of its webhooks' scope, and wait until the API server agrees:
    a TrainJob with a DISPATCH_ env (S3) is refused exactly while the engine is in scope."""
    ns = NAMESPACES[engine]
    cluster.kubectl("label", "namespace", ns, f"{ENGINE_LABEL}={engine if on else 'off'}", "--overwrite")
    probe = trainjob(name="scope-probe", namespace=ns, env=[{"name": "DISPATCH_PROBE", "value": "1"}])

    def agreed() -> bool:
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", probe, dry_run="All")
            refused = False
        except Exception:
            refused = True
        return refused == on

    eventually(agreed, f"{engine}'s namespace {'in' if on else 'out of'} scope", 60, every=0.2)


def run_case(cluster, custom, case: Case, engine: str, name: str) -> Outcome:
    ns = NAMESPACES[engine]
    job = _prepared(case, engine, name)
    if case.own_runtime:
        cluster.apply(_runtime_doc(job["spec"]["runtimeRef"]["name"]))
    if case.update is None:
        return _send(custom, ns, job)
    if case.pre_webhook:
        _scope(cluster, custom, engine, False)
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", job)
        finally:
            _scope(cluster, custom, engine, True)
    else:
        created = _send(custom, ns, job)
        if not created.allowed:
            return Outcome(False, "the old object was refused: " + created.message)
    if case.before_update:
        case.before_update(cluster, engine)
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", name)
    return _send(custom, ns, case.update(copy.deepcopy(stored)), replace=True)


def _send(custom, ns: str, obj: dict, replace: bool = False) -> Outcome:
    from kubernetes.client.exceptions import ApiException

    try:
        if replace:
            got = custom.replace_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", obj["metadata"]["name"], obj)
        else:
            got = custom.create_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", obj)
    except ApiException as exc:
        return Outcome(False, _message(exc), code=exc.status)
    entry, index = _own(got)
    return Outcome(True, "", entry, index)


def setup(cluster, engines: tuple[str, ...] = ("ours", "kyverno")) -> None:
    """The runtimes every case reads, and one namespace per engine."""
    for f in sorted((EXAMPLES / "runtimes").glob("*.yaml")):
        cluster.kubectl("apply", "-f", str(f))
    for doc in extra_runtimes():
        cluster.apply(doc)
    for engine in engines:
        ns = NAMESPACES[engine]
        cluster.apply({"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": ns, "labels": {ENGINE_LABEL: engine}}})
        for doc in namespaced_runtimes(ns):
            cluster.apply(doc)


@dataclass
class Result:
    case: Case
    ours: Outcome
    other: Outcome   # the engine compared with ours: Kyverno, or the in-tree policies

    @property
    def agree(self) -> bool:
        return agree(self.ours, self.other)

    @property
    def ours_as_spec_says(self) -> bool:
        return self.ours.allowed == (self.case.expect == "allow")

    @property
    def other_as_spec_says(self) -> bool:
        return self.other.allowed == (self.case.expect == "allow")


def run(cluster, other: str = "kyverno") -> list[Result]:
    custom = _api(cluster)
    results = []
    for i, case in enumerate(cases()):
        got = {engine: run_case(cluster, custom, case, engine, f"c{i:03d}") for engine in ("ours", other)}
        results.append(Result(case, got["ours"], got[other]))
    return results


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 1] + "…"


# Where a policy engine and our webhook answer differently on this corpus, and why (docs/alternatives.md).
LOOK_ALIKES = "look-alike characters: a policy compares code points; ours folds homoglyphs and invisible ones"


def look_alike_cases() -> dict[str, str]:
    """The corpus's look-alike cases (non-ASCII names and paths), by case id: neither JMESPath nor CEL folds them."""
    return {**{f"bypass S2: path {p!r} in {lst}": LOOK_ALIKES
               for lst in ("containers", "initContainers") for p in bypass.PATH_TRICKS if not p.isascii()},
            "bypass S1: reserved volume name, look-alike": LOOK_ALIKES,
            "bypass S3: DISPATCH_ env, look-alike": LOOK_ALIKES}


# How each engine's own refusals read (the rest are the API server's: Trainer's CRD schema and CEL rules,
# checked after the mutating admission and before the validating one).
ENGINE_REFUSAL = {"kyverno": "admission webhook", "cel": "ValidatingAdmissionPolicy"}


def by_crd(results: list[Result], other: str) -> list[Result]:
    """The agreements the API server's CRD validation refused for the other engine before it was asked."""
    return [r for r in results if r.agree and not r.other.allowed and ENGINE_REFUSAL[other] not in r.other.message]


def report(results: list[Result], other: str = "kyverno", every: bool = False) -> list[str]:
    """The counts, then one row per disagreement (per case, with `every`)."""
    agreed = sum(r.agree for r in results)
    label, crd = LABELS[other], by_crd(results, other)
    out = [f"{len(results)} TrainJobs through both ({sum(r.case.operation == 'CREATE' for r in results)} creates, "
           f"{sum(r.case.operation == 'UPDATE' for r in results)} updates): they agree on {agreed}, "
           f"disagree on {len(results) - agreed}. Ours answers {sum(r.ours_as_spec_says for r in results)} "
           f"of {len(results)} as SPEC says; {label} {sum(r.other_as_spec_says for r in results)}. "
           f"Of the agreements, {len(crd)} were refused for {label} by the API server's CRD validation before its "
           f"validating policies were asked: {'; '.join(r.case.id for r in crd)}.",
           "", f"| case | from | SPEC | ours | {label} |" + (" agree |" if every else ""),
           "|---|---|---|---|---|" + ("---|" if every else "")]
    for r in results:
        if every or not r.agree:
            ours, theirs = r.ours.summary(), r.other.summary()
            if r.ours.allowed and r.other.allowed and r.ours.entry and r.other.entry and r.ours.entry != r.other.entry:
                theirs += " (a different entry)"
            out.append(f"| {_cell(r.case.id, 90)} | {r.case.source} | {r.case.expect} | {_cell(ours)} | "
                       f"{_cell(theirs)} |" + ((" yes |" if r.agree else " **no** |") if every else ""))
    return out


def serve_ours(stack, cluster, tmp, beside: str) -> None:
    """Our route-1 webhook, registered on `cluster` for its engine's namespace: the side every comparison shares."""
    url, ca, log, proc = stack.enter_context(webhook_server(
        tmp / "ours", "--settings", str(EXAMPLES / "settings" / "route1.json"), "--kubeconfig", cluster.kubeconfig,
        env={"PROMETHEUS_MULTIPROC_DIR": ""}))
    LOGS[f"webhook (beside {beside})"] = log
    for doc in kyverno.our_configurations(Webhook(url, ca, log, proc)):
        cluster.apply(doc)
