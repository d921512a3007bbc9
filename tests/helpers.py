"""Builders shared by the tests: TrainJobs, runtimes, AdmissionReviews, decoded answers."""

from __future__ import annotations

import base64
import copy
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

from webhook.core import patch as patch_mod
from webhook.core.admission import Admission
from webhook.core.runtimes import RuntimeIndex, RuntimeUnavailable
from webhook.core.settings import parse

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DIGEST = "sha256:" + "0f3c8a1d2b4e5f60718293a4b5c6d7e8f9012a3b4c5d6e7f8091a2b3c4d5e6f7"
IMAGE = f"registry.gitlab.com/phpboyscout/go/dispatch/publish@{DIGEST}"
MANAGER = "dispatch.go.phpboyscout.uk/publish"
NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
NOW_TEXT = "2026-11-29T12:00:00Z"

ROUTE1 = {"publish": {"image": IMAGE}}
ROUTE2 = {"publish": {"image": IMAGE, "via": "initContainer", "initContainer": "dispatch-publish"}}
CREDS = {"credentials": [{"name": "checkpoint-store", "secret": "s3-credentials",
                          "mountPath": "/var/run/dispatch/creds"}]}


def settings(doc: dict | None = None):
    return parse(json.dumps(ROUTE1 if doc is None else doc))


def runtime(name="torch-distributed", kind="ClusterTrainingRuntime", namespace=None, torch=True,
            jobs=None) -> dict:
    """A runtime whose replicated jobs are given as {job: pod spec}; default one `node` job."""
    jobs = jobs if jobs is not None else {"node": {"containers": [{"name": "node", "image": "pytorch"}]}}
    meta = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    spec: dict = {"template": {"spec": {"replicatedJobs": [
        {"name": j, "template": {"spec": {"template": {"spec": copy.deepcopy(pod)}}}} for j, pod in jobs.items()
    ]}}}
    spec["mlPolicy"] = {"numNodes": 1, "torch": {}} if torch else {"numNodes": 1}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": kind, "metadata": meta, "spec": spec}


def stock_runtimes() -> RuntimeIndex:
    found = []
    for f in sorted((EXAMPLES / "runtimes").glob("*.yaml")):
        found += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return RuntimeIndex(found)


class Runtimes:
    """A runtime source whose runtimes can be edited or deleted between reviews, and that counts reads."""

    def __init__(self, *runtimes: dict, unavailable: bool = False):
        self.index = RuntimeIndex(list(runtimes))
        self.unavailable = unavailable
        self.reads = 0

    def get(self, kind, namespace, name):
        self.reads += 1
        if self.unavailable:
            raise RuntimeUnavailable("the API server cannot be reached")
        return self.index.get(kind, namespace, name)

    def ready(self) -> bool:
        return True


class Faulty:
    """A runtime source that breaks (a fault of the webhook) or cannot answer now."""

    def __init__(self, exc):
        self.exc = exc

    def get(self, kind, namespace, name):
        raise self.exc

    def ready(self):
        return True


class Clock:
    """A monotonic clock the test moves (`clock.now += 600`)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def trainjob(name="job", namespace="team-a", runtime_name="torch-distributed", kind=None, patches=None,
             env=None, suspend=None, **trainer) -> dict:
    ref = {"name": runtime_name}
    if kind:
        ref["kind"] = kind
    spec: dict = {"runtimeRef": ref}
    if trainer or env is not None:
        spec["trainer"] = dict(trainer)
        if env is not None:
            spec["trainer"]["env"] = env
    if patches is not None:
        spec["runtimePatches"] = patches
    if suspend is not None:
        spec["suspend"] = suspend
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def pod_patch(manager: str, pod_spec: dict, job: str = "node") -> dict:
    return {"manager": manager, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": job, "template": {"spec": {"template": {"spec": pod_spec}}}}]}}}}


def forged(**change):
    """An entry of our manager that is not what the settings produce: another image, pulled Always (S4)."""
    entry = pod_patch(MANAGER, {
        "volumes": [{"name": "dispatch-publish",
                     "image": {"reference": "evil/publish:latest", "pullPolicy": "Always"}}],
        "containers": [{"name": "node", "volumeMounts": [{"name": "dispatch-publish", "mountPath": "/opt/dispatch"}]}],
    })
    entry.update(change)
    return entry


def mount_patch(path: str, manager="example.com/other", container_list="containers", **extra) -> dict:
    return pod_patch(manager, {
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        container_list: [{"name": "node", "volumeMounts": [{"name": "scratch", "mountPath": path, **extra}]}],
    })


def review(obj, operation="CREATE", old=None, uid="uid-1", dry_run=False, resource="trainjobs",
           group="trainer.kubeflow.org", sub_resource=None) -> dict:
    meta = obj.get("metadata") if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict) else {}
    req = {
        "uid": uid,
        "kind": {"group": group, "version": "v1alpha1", "kind": "TrainJob"},
        "resource": {"group": group, "version": "v1alpha1", "resource": resource},
        "name": meta.get("name", ""),
        "namespace": meta.get("namespace", ""),
        "operation": operation,
        "object": obj,
        "dryRun": dry_run,
    }
    if old is not None:
        req["oldObject"] = old
    if sub_resource:
        req["subResource"] = sub_resource
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def admission(settings_doc=None, runtimes=None, now=NOW) -> Admission:
    return Admission(settings(settings_doc), runtimes if runtimes is not None else stock_runtimes(), clock=lambda: now)


def answer(adm: Admission, obj, endpoint="mutate", **kw) -> dict:
    return adm.review(review(obj, **kw), endpoint)[0]["response"]


def ops_of(resp: dict) -> list[dict]:
    return json.loads(base64.b64decode(resp["patch"])) if "patch" in resp else []


def mutated(adm: Admission, obj, **kw) -> dict:
    resp = answer(adm, obj, "mutate", **kw)
    assert resp["allowed"], resp.get("status")
    return patch_mod.apply(obj, ops_of(resp))


def fields(resp: dict) -> list[str]:
    return [c["field"] for c in resp["status"]["details"]["causes"]]


def sentinels(resp: dict) -> list[str]:
    return [c["message"].split(":")[0] for c in resp["status"]["details"]["causes"]]


def metric_samples(text: str, name: str, /, **labels: str) -> list[float]:
    """The values of the samples named `name` (the full sample name, `_total` included) whose labels include
    `labels`, parsed by prometheus_client's own text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def metric_series(text: str, name: str, /, **labels: str) -> list[tuple[dict, float]]:
    """(labels, value) of each sample named `name` whose labels include `labels` (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def metric_table(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape as (name, sorted labels) -> value (prometheus_client's parser), for tests that read
    many series of one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def table_total(table: dict[tuple[str, tuple], float], name: str, /, **labels: str) -> float:
    """The sum of a `metric_table`'s samples named `name` whose labels include `labels` (0 when there is none)."""
    return sum(v for (n, ls), v in table.items() if n == name and all((k, want) in ls for k, want in labels.items()))


def metric_total(text: str, name: str, /, **labels: str) -> float:
    """The sum of `metric_samples` (0 when there is none)."""
    return sum(metric_samples(text, name, **labels))


def eventually(check, what: str, timeout: float = 20, every: float = 0.1, detail=None):
    """`check()`'s first truthy value, polled every `every` seconds until `timeout`, then an AssertionError
    naming `what` (and `detail()`, when given: what the cluster looks like): the one waiter of the tests, for what
    a process does a moment after it answers (a metric counted after the answer is written, a log line through a
    queue, a watch delivering a change) or what a cluster converges to."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            more = f":\n{detail()}" if detail is not None else ""
            raise AssertionError(f"{what} (waited {timeout:.0f}s){more}")
        time.sleep(every)
