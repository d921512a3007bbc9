"""The bypass catalogue: TrainJobs crafted to sneak something into /opt/dispatch or forge the publish
patch. Shared by the core test and the real-server test; every case must be refused.

Each case is (id, operation, object, old object or None, rule). A trick sits beside the correct
computed entry (`computed_job` puts it there), so S5 (no entry) cannot refuse it first: the case must
be refused by `rule`, the rule it tries to get past. The invariant checked for each: the validating
endpoint refuses the object as sent, by that rule, and the mutating endpoint either refuses it or
returns a patch whose result holds nothing at /opt/dispatch but the webhook's computed entry.
"""

from __future__ import annotations

import copy

from tests.helpers import CREDS, IMAGE, MANAGER, mount_patch, pod_patch, trainjob
from webhook.core import paths

PATH_TRICKS = [
    "/opt/dispatch", "/opt/dispatch/", "//opt//dispatch", "///opt/dispatch", "/opt/./dispatch", "/opt/dispatch/.",
    "/opt/x/../dispatch", "/opt/dispatch/../dispatch/publish", "/../../opt/dispatch", "opt/dispatch",
    "./opt/dispatch/publish", "opt//dispatch//", "/opt/dispatch/publish", "/opt/dispatch/sub/dir/",
    # look-alikes: Cyrillic і and а, zero-width space, fullwidth solidus, division slash, soft hyphen
    "/opt/d\u0456spatch", "/opt/disp\u0430tch/publish", "/opt/dis\u200bpatch", "\uff0fopt\uff0fdispatch",
    "/opt\u2215dispatch", "/opt/dispatch\u00ad",
]


def _forged_entry(**over) -> dict:
    entry = pod_patch(MANAGER, {
        "volumes": [{"name": "dispatch-publish",
                     "image": {"reference": "evil.example/publish:latest", "pullPolicy": "Always"}}],
        "containers": [{"name": "node", "volumeMounts": [{"name": "dispatch-publish", "mountPath": "/opt/dispatch"}]}],
    })
    entry.update(over)
    return entry


def cases(computed_job) -> list[tuple[str, str, dict, dict | None, str]]:
    """`computed_job(job)` returns the job as the webhook mutates it: the correct entry is taken from it."""
    out: list[tuple[str, str, dict, dict | None, str]] = []

    def beside_entry(job: dict) -> dict:
        """The trick, plus the entry the webhook computes for the job's runtime (after the trick's entries)."""
        clean = trainjob(runtime_name=job["spec"]["runtimeRef"]["name"])
        own = next(e for e in computed_job(clean)["spec"]["runtimePatches"] if e["manager"] == MANAGER)
        job = copy.deepcopy(job)
        job["spec"].setdefault("runtimePatches", []).append(own)
        return job

    def create(name, job, rule, with_entry=True):
        out.append((name, "CREATE", beside_entry(job) if with_entry else job, None, rule))

    for lst in ("containers", "initContainers"):
        for p in PATH_TRICKS:
            create(f"path {p!r} in {lst}", trainjob(patches=[mount_patch(p, container_list=lst)]), "S2")
    for extra in ({"subPath": "publish"}, {"subPathExpr": "$(POD_NAME)"}, {"readOnly": True, "subPath": "../x"}):
        create(f"mount with {sorted(extra)}", trainjob(patches=[mount_patch("/opt/dispatch/publish", **extra)]), "S2")
    create("reserved volume name under another manager", trainjob(patches=[pod_patch(
        "example.com/other", {"volumes": [{"name": "dispatch-publish", "image": {"reference": IMAGE}}]})]), "S1")
    create("reserved volume name, look-alike", trainjob(patches=[pod_patch(
        "example.com/other", {"volumes": [{"name": "d\u0456spatch-publish", "emptyDir": {}}]})]), "S1")
    create("reserved volume mounted elsewhere by another manager", trainjob(patches=[pod_patch(
        "example.com/other", {"containers": [{"name": "node", "volumeMounts": [
            {"name": "dispatch-publish", "mountPath": "/tmp/writable"}]}]})]), "S1")
    create("image volume named otherwise, mounted at /opt/dispatch", trainjob(patches=[pod_patch(
        "example.com/other", {"volumes": [{"name": "tools", "image": {"reference": "evil.example/publish:1"}}],
                              "containers": [{"name": "node", "volumeMounts": [
                                  {"name": "tools", "mountPath": "/opt/dispatch", "readOnly": True}]}]})]), "S2")
    create("same container patched by two managers", trainjob(patches=[
        pod_patch("a.example.com/one", {"volumes": [{"name": "a", "emptyDir": {}}],
                                        "containers": [{"name": "node",
                                                        "volumeMounts": [{"name": "a", "mountPath": "/opt"}]}]}),
        pod_patch("b.example.com/two", {"containers": [{"name": "node", "volumeMounts": [
            {"name": "a", "mountPath": "/opt/dispatch/publish"}]}]}),
    ]), "S2")
    create("launcher job patched instead of node", trainjob(runtime_name="mpi-launcher", patches=[
        pod_patch("example.com/other", {"containers": [{"name": "node", "volumeMounts": [
            {"name": "x", "mountPath": "/opt/dispatch"}]}]}, job="launcher")]), "S2")
    create("DISPATCH_ env in trainer", trainjob(env=[{"name": "DISPATCH_PUBLISH_DEST", "value": "/tmp"}]), "S3")
    create("DISPATCH_ env, look-alike", trainjob(env=[{"name": "D\u0406SPATCH_X", "value": "1"}]), "S3")
    create("DISPATCH_PUBLISH_DEST redirected on the init container by another manager", trainjob(
        runtime_name="torch-init", patches=[pod_patch("example.com/other", {"initContainers": [
            {"name": "dispatch-publish", "env": [{"name": "DISPATCH_PUBLISH_DEST", "value": "/tmp"}]}]})]), "S3")
    cred = CREDS["credentials"][0]
    create("credential volume redefined by a later entry", trainjob(patches=[pod_patch(
        "example.com/other", {"volumes": [{"name": cred["name"], "emptyDir": {}}]})]), "S6")
    create("mount under a credential's path by another entry", trainjob(patches=[mount_patch(
        cred["mountPath"] + "/../creds/token")]), "S6")
    create("forged entry under the webhook's manager (validate)", trainjob(patches=[_forged_entry()]), "S4", False)
    create("forged entry with a tagged image, listed first",
           trainjob(patches=[_forged_entry(), {"manager": "example.com/other"}]), "S4", False)
    create("two entries under the webhook's manager", trainjob(patches=[_forged_entry()]), "S4")
    genuine = computed_job(trainjob(suspend=True))
    tampered = copy.deepcopy(genuine)
    own = next(e for e in tampered["spec"]["runtimePatches"] if e["manager"] == MANAGER)
    pod = own["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["volumes"][0]["image"]["reference"] = "evil.example/publish:latest"
    out.append(("forged entry on update", "UPDATE", tampered, genuine, "update"))
    writable = copy.deepcopy(genuine)
    own = next(e for e in writable["spec"]["runtimePatches"] if e["manager"] == MANAGER)
    own["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["volumeMounts"][0]["readOnly"] = False
    out.append(("publish mount made writable on update", "UPDATE", writable, genuine, "update"))
    added = copy.deepcopy(genuine)
    added["spec"]["runtimePatches"].insert(0, mount_patch("/opt/dispatch/x"))
    out.append(("mount added on update of a suspended job", "UPDATE", added, genuine, "S2"))
    huge = trainjob(patches=[mount_patch(f"/data/{i}", manager=f"m{i}.example.com/x") for i in range(14)],
                    env=[{"name": f"V{i}", "value": "x" * 1000} for i in range(2000)])
    huge["spec"]["runtimePatches"][7] = mount_patch("/opt//dispatch", manager="m7.example.com/x")
    create("huge object hiding one mount", huge, "S2")
    deep = trainjob(patches=[mount_patch("/opt/dispatch")])
    nest: dict = {}
    cur = nest
    for _ in range(400):
        cur["x"] = {}
        cur = cur["x"]
    deep["spec"]["trainer"] = {"resourcesPerNode": {"claims": [nest]}}
    create("deeply nested object hiding one mount", deep, "S2")
    return out


def publish_mounts(job):
    """Every mount at or under /opt/dispatch (or looking like it) outside the webhook's own entry."""
    for entry in job["spec"].get("runtimePatches") or []:
        if entry.get("manager") == MANAGER:
            continue
        for rj in entry.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", []):
            pod = rj["template"]["spec"]["template"]["spec"]
            for lst in ("containers", "initContainers"):
                for c in pod.get(lst, []):
                    for m in c.get("volumeMounts", []):
                        if paths.under_publish_dir(paths.skeleton(m["mountPath"])):
                            yield m
