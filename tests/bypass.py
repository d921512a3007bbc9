"""The bypass catalogue: TrainJobs crafted to sneak something into /opt/dispatch or forge the publish
patch. Shared by the core test and the real-server test; every case must be refused.

Each case is (id, operation, object, old object or None). The invariant checked for each: the
validating endpoint refuses the object as sent, and the mutating endpoint either refuses it or
returns a patch whose result holds nothing at /opt/dispatch but the webhook's computed entry.
"""

from __future__ import annotations

import copy

from tests.helpers import IMAGE, MANAGER, mount_patch, pod_patch, trainjob

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
        "volumes": [{"name": "dispatch-publish", "image": {"reference": "evil.example/publish:latest", "pullPolicy": "Always"}}],
        "containers": [{"name": "node", "volumeMounts": [{"name": "dispatch-publish", "mountPath": "/opt/dispatch"}]}],
    })
    entry.update(over)
    return entry


def cases(computed_job) -> list[tuple[str, str, dict, dict | None]]:
    """`computed_job(job)` returns the job as the webhook mutates it (for update cases)."""
    out: list[tuple[str, str, dict, dict | None]] = []
    for lst in ("containers", "initContainers"):
        for p in PATH_TRICKS:
            out.append((f"path {p!r} in {lst}", "CREATE", trainjob(patches=[mount_patch(p, container_list=lst)]), None))
    for extra in ({"subPath": "publish"}, {"subPathExpr": "$(POD_NAME)"}, {"readOnly": True, "subPath": "../x"}):
        out.append((f"mount with {sorted(extra)}", "CREATE", trainjob(patches=[mount_patch("/opt/dispatch/publish", **extra)]), None))
    out.append(("reserved volume name under another manager", "CREATE", trainjob(patches=[pod_patch(
        "example.com/other", {"volumes": [{"name": "dispatch-publish", "image": {"reference": IMAGE}}]})]), None))
    out.append(("reserved volume name, look-alike", "CREATE", trainjob(patches=[pod_patch(
        "example.com/other", {"volumes": [{"name": "d\u0456spatch-publish", "emptyDir": {}}]})]), None))
    out.append(("reserved volume mounted elsewhere by another manager", "CREATE", trainjob(patches=[pod_patch(
        "example.com/other", {"containers": [{"name": "node", "volumeMounts": [
            {"name": "dispatch-publish", "mountPath": "/tmp/writable"}]}]})]), None))
    out.append(("image volume named otherwise, mounted at /opt/dispatch", "CREATE", trainjob(patches=[pod_patch(
        "example.com/other", {"volumes": [{"name": "tools", "image": {"reference": "evil.example/publish:1"}}],
                              "containers": [{"name": "node", "volumeMounts": [
                                  {"name": "tools", "mountPath": "/opt/dispatch", "readOnly": True}]}]})]), None))
    out.append(("same container patched by two managers", "CREATE", trainjob(patches=[
        pod_patch("a.example.com/one", {"volumes": [{"name": "a", "emptyDir": {}}],
                                        "containers": [{"name": "node", "volumeMounts": [{"name": "a", "mountPath": "/opt"}]}]}),
        pod_patch("b.example.com/two", {"containers": [{"name": "node", "volumeMounts": [
            {"name": "a", "mountPath": "/opt/dispatch/publish"}]}]}),
    ]), None))
    out.append(("launcher job patched instead of node", "CREATE", trainjob(runtime_name="mpi-launcher", patches=[
        pod_patch("example.com/other", {"containers": [{"name": "node", "volumeMounts": [
            {"name": "x", "mountPath": "/opt/dispatch"}]}]}, job="launcher")]), None))
    out.append(("DISPATCH_ env in trainer", "CREATE", trainjob(env=[{"name": "DISPATCH_PUBLISH_DEST", "value": "/tmp"}]), None))
    out.append(("DISPATCH_ env, look-alike", "CREATE", trainjob(env=[{"name": "D\u0406SPATCH_X", "value": "1"}]), None))
    out.append(("DISPATCH_PUBLISH_DEST redirected on the init container by another manager", "CREATE", trainjob(
        runtime_name="torch-init", patches=[pod_patch("example.com/other", {"initContainers": [
            {"name": "dispatch-publish", "env": [{"name": "DISPATCH_PUBLISH_DEST", "value": "/tmp"}]}]})]), None))
    out.append(("forged entry under the webhook's manager (validate)", "CREATE", trainjob(patches=[_forged_entry()]), None))
    out.append(("forged entry with a tagged image, listed first", "CREATE",
                trainjob(patches=[_forged_entry(), {"manager": "example.com/other"}]), None))
    out.append(("two entries under the webhook's manager", "CREATE",
                trainjob(patches=[_forged_entry(), _forged_entry()]), None))
    genuine = computed_job(trainjob(suspend=True))
    tampered = copy.deepcopy(genuine)
    own = next(e for e in tampered["spec"]["runtimePatches"] if e["manager"] == MANAGER)
    pod = own["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["volumes"][0]["image"]["reference"] = "evil.example/publish:latest"
    out.append(("forged entry on update", "UPDATE", tampered, genuine))
    writable = copy.deepcopy(genuine)
    own = next(e for e in writable["spec"]["runtimePatches"] if e["manager"] == MANAGER)
    own["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["volumeMounts"][0]["readOnly"] = False
    out.append(("publish mount made writable on update", "UPDATE", writable, genuine))
    added = copy.deepcopy(genuine)
    added["spec"]["runtimePatches"].insert(0, mount_patch("/opt/dispatch/x"))
    out.append(("mount added on update of a suspended job", "UPDATE", added, genuine))
    huge = trainjob(patches=[mount_patch(f"/data/{i}", manager=f"m{i}.example.com/x") for i in range(15)],
                    env=[{"name": f"V{i}", "value": "x" * 1000} for i in range(2000)])
    huge["spec"]["runtimePatches"][7] = mount_patch("/opt//dispatch", manager="m7.example.com/x")
    out.append(("huge object hiding one mount", "CREATE", huge, None))
    deep = trainjob(patches=[mount_patch("/opt/dispatch")])
    nest: dict = {}
    cur = nest
    for _ in range(400):
        cur["x"] = {}
        cur = cur["x"]
    deep["spec"]["trainer"] = {"resourcesPerNode": {"claims": [nest]}}
    out.append(("deeply nested object hiding one mount", "CREATE", deep, None))
    return out
