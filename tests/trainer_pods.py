"""The pod specs Trainer v2.3.0 and JobSet v0.12.0 build from a runtime and a TrainJob, and what each merge
step replaced on the way: a test harness (issue 34), so that a TrainJob's pods can be checked for the
webhook's volumes and mounts meeting another's (Trainer keeps one of the two, silently).

The steps, in Trainer's order (file paths are in the Go modules, `go mod download` puts them in the module cache):
1. The runtime's `spec.template.spec` (a JobSet spec), then each `spec.runtimePatches` entry in list order,
   merged as a strategic merge patch against `JobSetSpec` (Trainer: pkg/runtime/core/trainingruntime.go,
   mergeRuntimePatches: `strategicpatch.StrategicMergePatch(source, patch, jobsetv1alpha2.JobSetSpec{})`, then
   the replicated jobs put back in the runtime's order, which this merge never changes). The keyed lists are
   those of JobSet's and Kubernetes' types: replicated jobs by name (jobset api/jobset/v1alpha2/jobset_types.go),
   containers, init containers and volumes by name, mounts by mountPath, env by name (k8s.io/api/core/v1/types.go
   `patchMergeKey`). A matched item is merged key by key (Trainer sends no `$retainKeys` directive); other lists
   are replaced; maps merge.
2. Trainer's plugins (pkg/runtime/framework/plugins/...), each an upsert (pkg/apply/apply.go: volumes by name,
   mounts by path, env by name), applied to the pods after the patches:
   - mpi/mpi.go: jobs `node` and `launcher` get volume `mpi-ssh-auth`, their `node` container mounts it at
     `mlPolicy.mpi.sshAuthMountPath` (CRD default /root/.ssh); the launcher's also mounts `mpi-hostfile` at
     /etc/mpi;
   - flux/flux.go: job `node` gets five volumes, its `node` container mounts /mnt/flux, /opt/software,
     /etc/flux-config, /curve and /dev/shm, and an init container `flux-installer` is added;
   - trainjobstatus/trainjobstatus.go (behind the TrainJobStatus feature gate, off by default: modelled on,
     the worst case): every container of the first job whose ancestor label is `trainer` mounts
     /var/run/secrets/kubeflow/trainer.
   Their order is the plugin registry's map order (random in Go); they write different paths, and all of
   them come after the patches, which is what matters here. Then `spec.trainer.env` is upserted into the
   `node` containers of the trainer jobs, and of job `node` where MPI runs the launcher as a node
   (plugins/jobset/builder.go, Trainer).
3. JobSet's controller adds a volume per `volumeClaimPolicies` claim template to every job whose containers
   mount a volume of that name (jobset pkg/controllers/volume_claim_policy.go, addVolumes): appended, not
   upserted, so a volume of that name already there makes two.

A collision is recorded wherever an item meets another of its key and the two differ, each named by its origin:
the runtime, `patch MANAGER`, `plugin NAME`, `trainjob spec.trainer.env`, `jobset volumeClaimPolicies`.
Not modelled, as none of them touches volumes or mounts: the torch, jax and xgboost plugins' env, the
initializer builder's env, resources, images and commands. Items are read as the typed Go structs read them:
a `null` or an empty list is absent (`omitempty`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

ORIGIN = "\0origin"  # where a volume, mount or env item came from; stripped from the pods returned
RUNTIME = "runtime"
CLAIMS = "jobset volumeClaimPolicies"
TRAINER_ENV = "trainjob spec.trainer.env"
NODE, LAUNCHER, TRAINER_ANCESTOR = "node", "launcher", "trainer"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
DEFAULT_SSH_AUTH_MOUNT_PATH = "/root/.ssh"  # the CRD's default for mlPolicy.mpi.sshAuthMountPath

# Strategic-merge keys by field name, as Kubernetes' and JobSet's types declare them (patchMergeKey).
MERGE_KEYS = {"replicatedJobs": "name", "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
              "volumes": "name", "volumeMounts": "mountPath", "env": "name", "ports": "containerPort",
              "imagePullSecrets": "name", "schedulingGates": "name", "resourceClaims": "name",
              "volumeDevices": "devicePath"}
TRACKED = {"volumes": "volume", "volumeMounts": "mount", "env": "env"}


@dataclass(frozen=True)
class Collision:
    """Two items of one key met in one pod: `later` replaced (or, for JobSet's claims, duplicated) `earlier`."""

    job: str
    container: str      # "" for a pod's volume
    what: str           # volume | mount | env
    key: str            # the volume or env name, or the mountPath
    earlier: str
    later: str

    def __str__(self) -> str:
        where = f"{self.job}" + (f"/{self.container}" if self.container else "")
        verb = "duplicates" if self.later == CLAIMS else "replaces"
        return f"{where}: {self.what} {self.key!r} of {self.later} {verb} the one of {self.earlier}"


@dataclass
class Pod:
    job: str
    spec: dict                              # the pod spec as built, origins stripped
    collisions: list[Collision] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # jobs and containers the entries add, which the runtime lacks

    def duplicates(self) -> list[str]:
        """Volume names and, per container, mountPaths that occur twice in the pod as built."""
        found = []
        names = [v.get("name") for v in self.spec.get("volumes") or []]
        found += [f"volume {n!r}" for n in sorted({n for n in names if names.count(n) > 1})]
        for lst in ("initContainers", "containers"):
            for c in self.spec.get(lst) or []:
                paths = [m.get("mountPath") for m in c.get("volumeMounts") or []]
                found += [f"{c.get('name')}: mount {p!r}" for p in sorted({p for p in paths if paths.count(p) > 1})]
        return found


def _present(value) -> bool:
    return value is not None and value != []


def _tag(value, origin: str, lst: str | None = None):
    """A copy of `value` with every tracked item (volume, mount, env) marked with its origin."""
    if isinstance(value, dict):
        return {k: _tag(v, origin, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [_tag(v, origin) for v in value]
        if lst in TRACKED:
            items = [{**i, ORIGIN: origin} if isinstance(i, dict) else i for i in items]
        return items
    return value


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != ORIGIN}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class _Merge:
    """One build: the merges record their collisions here, by job and container."""

    def __init__(self):
        self.collisions: list[Collision] = []
        self.added: list[tuple[str, str]] = []  # (job, what): jobs and containers an entry adds to the template
        self.job = self.container = self.origin = ""

    def map(self, base: dict, patch: dict) -> dict:
        out = dict(base)
        for k, v in patch.items():
            if k == ORIGIN or not _present(v):
                continue
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = self.map(out[k], v)
            elif isinstance(v, list) and k in MERGE_KEYS and isinstance(out.get(k, []), list):
                out[k] = self.keyed(k, out.get(k, []), v)
            else:
                out[k] = copy.deepcopy(v)
        if ORIGIN in patch:
            out[ORIGIN] = patch[ORIGIN]
        return out

    def keyed(self, lst: str, base: list, patch: list) -> list:
        key = MERGE_KEYS[lst]
        out = list(base)
        for item in patch:
            if not isinstance(item, dict):
                continue
            at = next((i for i, b in enumerate(out) if isinstance(b, dict) and b.get(key) == item.get(key)), None)
            if at is None:
                if lst in ("replicatedJobs", "containers", "initContainers"):
                    job = str(item.get("name")) if lst == "replicatedJobs" else self.job
                    what = "replicated job" if lst == "replicatedJobs" else lst[:-1]
                    self.added.append((job, f"{job}: {self.origin} adds {what} {item.get('name')!r},"
                                            " which the runtime lacks"))
                out.append(copy.deepcopy(item))
                continue
            if lst in ("replicatedJobs", "containers", "initContainers"):
                outer = (self.job, self.container)
                if lst == "replicatedJobs":
                    self.job = str(item.get("name"))
                else:
                    self.container = str(item.get("name"))
                out[at] = self.map(out[at], item)
                self.job, self.container = outer
                continue
            self.note(lst, out[at], item)
            out[at] = self.map(out[at], item)
        return out

    def note(self, lst: str, earlier: dict, later: dict) -> None:
        if lst in TRACKED and _plain(earlier) != _plain(later):  # one origin may collide with itself too
            self.collisions.append(Collision(self.job, "" if lst == "volumes" else self.container, TRACKED[lst],
                                             str(later.get(MERGE_KEYS[lst])), str(earlier.get(ORIGIN)),
                                             str(later.get(ORIGIN))))

    def upsert(self, job: str, container: str, owner: dict, lst: str, items: list[dict], origin: str) -> None:
        """pkg/apply/apply.go: replace the item of the same key in place, else append."""
        self.job, self.container = job, container
        key = MERGE_KEYS[lst]
        current = owner.setdefault(lst, [])
        for item in items:
            item = {**item, ORIGIN: origin}
            at = next((i for i, b in enumerate(current) if b.get(key) == item[key]), None)
            if at is None:
                current.append(item)
            else:
                self.note(lst, current[at], item)
                current[at] = item
        self.job = self.container = ""


def _pod(rj: dict) -> dict:
    spec = rj.setdefault("template", {}).setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
    return spec


def _ancestor(rj: dict) -> str | None:
    return (((rj.get("template") or {}).get("metadata") or {}).get("labels") or {}).get(ANCESTOR_LABEL)


def _containers(pod: dict, name: str, lst: str = "containers") -> list[dict]:
    return [c for c in pod.get(lst) or [] if isinstance(c, dict) and c.get("name") == name]


def _mpi(m: _Merge, jobs: list[dict], mpi: dict, trainjob_name: str) -> None:
    ssh = mpi.get("sshAuthMountPath") or DEFAULT_SSH_AUTH_MOUNT_PATH
    for rj in jobs:
        name = rj.get("name")
        if name not in (NODE, LAUNCHER):
            continue
        pod, origin = _pod(rj), "plugin mpi"
        m.upsert(name, "", pod, "volumes", [{"name": "mpi-ssh-auth",
                                             "secret": {"secretName": f"{trainjob_name}-mpi-ssh-auth"}}], origin)
        if name == LAUNCHER:
            m.upsert(name, "", pod, "volumes", [{"name": "mpi-hostfile",
                                                 "configMap": {"name": f"{trainjob_name}-mpi-hostfile"}}], origin)
        for c in _containers(pod, NODE):
            m.upsert(name, NODE, c, "volumeMounts", [{"name": "mpi-ssh-auth", "mountPath": ssh}], origin)
            if name == LAUNCHER:
                m.upsert(name, NODE, c, "volumeMounts", [{"name": "mpi-hostfile", "mountPath": "/etc/mpi"}], origin)


def _flux(m: _Merge, jobs: list[dict], trainjob_name: str) -> None:
    entrypoint, origin = f"{trainjob_name}-flux-entrypoint", "plugin flux"
    for rj in jobs:
        if rj.get("name") != NODE:
            continue
        pod = _pod(rj)
        m.upsert(NODE, "", pod, "volumes", [
            {"name": "spack-install", "emptyDir": {}}, {"name": "flux-install", "emptyDir": {}},
            {"name": entrypoint, "configMap": {"name": entrypoint}},
            {"name": "shared-memory", "emptyDir": {"medium": "Memory"}},
            {"name": "flux-curve", "secret": {"secretName": f"{trainjob_name}-flux-curve"}}], origin)
        pod.setdefault("initContainers", []).append({"name": "flux-installer", "volumeMounts": [
            {"name": "flux-install", "mountPath": "/mnt/flux", ORIGIN: origin},
            {"name": entrypoint, "mountPath": "/etc/flux-config", "readOnly": True, ORIGIN: origin}]})
        for c in _containers(pod, NODE):
            m.upsert(NODE, NODE, c, "volumeMounts", [
                {"name": "flux-install", "mountPath": "/mnt/flux"},
                {"name": "spack-install", "mountPath": "/opt/software"},
                {"name": entrypoint, "mountPath": "/etc/flux-config", "readOnly": True},
                {"name": "flux-curve", "mountPath": "/curve", "readOnly": True},
                {"name": "shared-memory", "mountPath": "/dev/shm", "readOnly": True}], origin)


def _trainjob_status(m: _Merge, jobs: list[dict]) -> None:
    rj = next((j for j in jobs if _ancestor(j) == TRAINER_ANCESTOR), None)
    if rj is None:
        return
    pod, origin = _pod(rj), "plugin trainjobstatus"
    for c in pod.get("containers") or []:
        m.upsert(rj.get("name"), c.get("name"), c, "volumeMounts", [
            {"name": "kubeflow-trainer-token", "mountPath": "/var/run/secrets/kubeflow/trainer", "readOnly": True}],
            origin)
    m.upsert(rj.get("name"), "", pod, "volumes", [{"name": "kubeflow-trainer-token", "projected": {}}], origin)


def _trainer_env(m: _Merge, jobs: list[dict], env: list, launcher_as_node: bool) -> None:
    items = [e for e in env if isinstance(e, dict) and "name" in e]
    if not items:
        return
    for rj in jobs:
        if _ancestor(rj) != TRAINER_ANCESTOR and not (launcher_as_node and rj.get("name") == NODE):
            continue
        for c in _containers(_pod(rj), NODE):
            m.upsert(rj.get("name"), NODE, c, "env", items, TRAINER_ENV)


def _claims(m: _Merge, jobs: list[dict], spec: dict, trainjob_name: str) -> None:
    names = [t.get("metadata", {}).get("name") for p in spec.get("volumeClaimPolicies") or []
             for t in p.get("templates") or []]
    for rj in jobs:
        pod = _pod(rj)
        mounted = {mt.get("name") for lst in ("containers", "initContainers") for c in pod.get(lst) or []
                   for mt in c.get("volumeMounts") or []}
        for name in names:
            if name not in mounted:
                continue
            volumes = pod.setdefault("volumes", [])
            for v in volumes:
                if v.get("name") == name:
                    m.collisions.append(Collision(str(rj.get("name")), "", "volume", name, str(v.get(ORIGIN)), CLAIMS))
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": f"{name}-{trainjob_name}"},
                            ORIGIN: CLAIMS})


def build_pods(runtime: dict, trainjob: dict) -> dict[str, Pod]:
    """The pod spec of each replicated job of the JobSet Trainer builds for `trainjob` on `runtime`, by job."""
    rspec = runtime.get("spec") or {}
    jobset = _tag(copy.deepcopy((rspec.get("template") or {}).get("spec") or {}), RUNTIME)
    m = _Merge()
    tspec = trainjob.get("spec") or {}
    for entry in tspec.get("runtimePatches") or []:
        patch = ((((entry or {}).get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec"))
        if isinstance(patch, dict):
            m.origin = f"patch {entry.get('manager')}"
            jobset = m.map(jobset, _tag(patch, m.origin))
    jobs = jobset.get("replicatedJobs") or []
    name = str((trainjob.get("metadata") or {}).get("name") or "trainjob")
    policy = rspec.get("mlPolicy") or {}
    if isinstance(policy.get("mpi"), dict):
        _mpi(m, jobs, policy["mpi"], name)
    if isinstance(policy.get("flux"), dict):
        _flux(m, jobs, name)
    _trainjob_status(m, jobs)
    launcher_as_node = isinstance(policy.get("mpi"), dict) and policy["mpi"].get("runLauncherAsNode") is True
    _trainer_env(m, jobs, (tspec.get("trainer") or {}).get("env") or [], launcher_as_node)
    _claims(m, jobs, jobset, name)
    pods = {}
    for rj in jobs:
        job = str(rj.get("name"))
        pods[job] = Pod(job, _plain(_pod(rj)), [c for c in m.collisions if c.job == job],
                        [text for j, text in m.added if j == job])
    return pods


def added_by(pods: dict[str, Pod], origin: str) -> list[str]:
    """The replicated jobs and containers `origin` names that the runtime lacks: the strategic merge appends
    them (a container without an image, a job without a pod), and Trainer v2.3.0's webhook does not refuse them,
    as it checks the patches against the template they were already merged into (plugins/jobset/jobset.go,
    Validate, given the info of pkg/runtime/core/*trainingruntime.go, newRuntimeInfo)."""
    return [a for p in pods.values() for a in p.added if f": {origin} adds " in a]


def collisions_with(pods: dict[str, Pod], origin: str) -> list[str]:
    """Where an item of `origin` (say `patch MANAGER`) met another of its key, one line each."""
    return [str(c) for p in pods.values() for c in p.collisions if origin in (c.earlier, c.later)]


def missing(pods: dict[str, Pod], entry: dict) -> list[str]:
    """The volumes and mounts of a runtimePatches `entry` that the built pods do not hold as the entry wrote them."""
    lost = []
    for rj in ((((entry.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {})
               .get("replicatedJobs") or []):
        job = rj.get("name")
        spec = (((rj.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        pod = pods[job].spec if job in pods else {}
        lost += [f"{job}: volume {v.get('name')!r}" for v in spec.get("volumes") or []
                 if v not in pod.get("volumes", [])]
        for lst in ("initContainers", "containers"):
            for c in spec.get(lst) or []:
                built = next((b for b in pod.get(lst) or [] if b.get("name") == c.get("name")), {})
                lost += [f"{job}/{c.get('name')}: mount {mt.get('mountPath')!r}" for mt in c.get("volumeMounts") or []
                         if mt not in built.get("volumeMounts", [])]
    return lost
