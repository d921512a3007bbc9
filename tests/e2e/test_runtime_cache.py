"""One runtime cache per pod (issue 25): serve's master forks one keeper that lists and watches the
runtimes into a store every worker reads. Against the real API server: one list and one watch per kind
whatever the number of workers, a runtime created later reaching every worker through that one watch,
and a keeper that dies replaced by the master while the workers go on answering from the store."""

from __future__ import annotations

import json
import os
import signal

import requests

from tests.e2e.conftest import Webhook
from tests.helpers import EXAMPLES, review, runtime, trainjob
from tests.process import eventually, webhook_server

KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
REQUESTS = "dispatch_admission_api_requests_total"


def serve(env, tmp, workers: int = 3):
    return webhook_server(tmp, "--settings", str(EXAMPLES / "settings" / "route1.json"), "--kubeconfig",
                          env.cluster.kubeconfig, "--workers", str(workers), env={"PROMETHEUS_MULTIPROC_DIR": ""})


def keepers(log) -> list[int]:
    """The pids of the runtime keepers the master started, in order (from its log)."""
    pids = []
    for line in log.read_text().splitlines():
        if '"runtime keeper started"' in line:
            pids.append(json.loads(line[line.index("{"):])["pid"])
    return pids


def mutate(hook: Webhook, runtime_name: str) -> dict:
    """One review on a new connection (so reviews land on every worker, not one)."""
    got = requests.post(hook.url + "/mutate", json=review(trainjob(runtime_name=runtime_name)), verify=hook.ca,
                        headers={"Connection": "close"}, timeout=10)
    assert got.status_code == 200, got.text
    return got.json()["response"]


def add_runtime(env, name: str) -> None:
    doc = runtime(name)
    doc["apiVersion"] = "trainer.kubeflow.org/v1alpha1"
    env.cluster.apply(doc)


def test_one_list_and_one_watch_per_kind_whatever_the_workers(env, tmp_path):
    with serve(env, tmp_path / "w3") as (url, ca, log, proc):
        hook = Webhook(url, ca, log, proc)
        assert len(keepers(log)) == 1
        size = hook.metric("dispatch_admission_runtime_cache_size", kind="ClusterTrainingRuntime")
        for kind in KINDS:
            assert hook.metric(REQUESTS, verb="list", kind=kind) == 1, f"{kind}: one list for the pod, not one a worker"
            assert hook.metric(REQUESTS, verb="watch", kind=kind) == 1, f"{kind}: one watch for the pod"
        add_runtime(env, "cache-shared-new")
        eventually(lambda: hook.metric("dispatch_admission_runtime_cache_size", kind="ClusterTrainingRuntime")
                   == size + 1, "the keeper's watch brings the new runtime to the store")
        gets = hook.metric(REQUESTS, verb="get")
        for _ in range(12):
            assert mutate(hook, "cache-shared-new")["allowed"]
        assert hook.metric(REQUESTS, verb="get") == gets, "every worker found it in the pod's store: no live read"
        assert len(hook.metrics().split("dispatch_admission_runtime_cache_size{")) == 3  # one series per kind


def test_a_keeper_that_dies_is_replaced_and_the_workers_answer_meanwhile(env, tmp_path):
    with serve(env, tmp_path / "kill", workers=2) as (url, ca, log, proc):
        hook = Webhook(url, ca, log, proc)
        size = hook.metric("dispatch_admission_runtime_cache_size", kind="ClusterTrainingRuntime")
        first = keepers(log)[0]
        os.kill(first, signal.SIGKILL)
        assert mutate(hook, "torch-distributed")["allowed"], "the store outlives its writer"
        second = eventually(lambda: keepers(log)[1:], "the master starts another keeper")[0]
        assert second != first and proc.poll() is None
        # Created after the first keeper died: only the second one's list or watch can bring it to the store
        # (the dead keeper's gauge left with it, so the size is the new keeper's own count).
        add_runtime(env, "cache-after-restart")
        eventually(lambda: hook.metric("dispatch_admission_runtime_cache_size", kind="ClusterTrainingRuntime")
                   == size + 1, "the new keeper lists and watches again")
        assert mutate(hook, "cache-after-restart")["allowed"]
    assert not os.path.exists(f"/proc/{second}"), "the keeper stops with serve"
