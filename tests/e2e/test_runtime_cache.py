"""One runtime cache per pod (issues 25 and 33): one keeper lists and watches the runtimes into a store every
worker reads. Against the real API server: one list and one watch per kind whatever the number of workers, a
runtime created later reaching every worker through that one watch; and, with the keeper run apart as the
chart's sidecar runs it (`serve --runtime-keeper external` beside `dispatch-admission keep`), a keeper that
dies leaves the workers answering from the last synced store, saying how old it is, until another one
lists again into the same store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import requests

from tests.e2e.webhooks import Webhook
from tests.helpers import EXAMPLES, review, runtime, trainjob
from tests.process import ROOT, eventually, stop, webhook_server

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
            eventually(lambda kind=kind: hook.metric(REQUESTS, verb="watch", kind=kind),
                       "the keeper's state written (each second)")
            assert hook.metric(REQUESTS, verb="watch", kind=kind) == 1, f"{kind}: one watch for the pod"
        add_runtime(env, "cache-shared-new")
        eventually(lambda: hook.metric("dispatch_admission_runtime_cache_size", kind="ClusterTrainingRuntime")
                   == size + 1, "the keeper's watch brings the new runtime to the store")
        gets = hook.metric(REQUESTS, verb="get")
        for _ in range(12):
            assert mutate(hook, "cache-shared-new")["allowed"]
        assert hook.metric(REQUESTS, verb="get") == gets, "every worker found it in the pod's store: no live read"
        assert len(hook.metrics().split("dispatch_admission_runtime_cache_size{")) == 3  # one series per kind


def keeper(env, store, log):
    """`dispatch-admission keep` on `store`, as the chart's sidecar runs it."""
    out = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "webhook", "keep", "--runtime-store", str(store), "--kubeconfig",
                             env.cluster.kubeconfig], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def test_a_keeper_that_dies_leaves_the_store_answering_and_another_takes_it_over(env, tmp_path):
    store, klog = tmp_path / "store", tmp_path / "keeper.log"
    first = keeper(env, store, klog)
    try:
        with webhook_server(tmp_path / "ext", "--settings", str(EXAMPLES / "settings" / "route1.json"),
                            "--kubeconfig", env.cluster.kubeconfig, "--workers", "2", "--runtime-store", str(store),
                            "--runtime-keeper", "external",
                            env={"PROMETHEUS_MULTIPROC_DIR": ""}) as (url, ca, log, proc):
            hook = Webhook(url, ca, log, proc)
            assert keepers(log) == [], "serve starts no keeper of its own"
            size = hook.metric("dispatch_admission_runtime_cache_size", kind="ClusterTrainingRuntime")
            assert hook.metric("dispatch_admission_runtime_keeper_starts_total") == 1
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            assert mutate(hook, "torch-distributed")["allowed"], "the store outlives its writer"
            missing = mutate(hook, "created-while-no-keeper")
            assert missing["status"]["code"] == 503 and "keeper cannot be asked" in missing["status"]["message"]
            age = hook.metric("dispatch_admission_runtime_cache_age_seconds", kind="ClusterTrainingRuntime")
            eventually(lambda: hook.metric("dispatch_admission_runtime_cache_age_seconds",
                                           kind="ClusterTrainingRuntime")
                       >= age + 2, "the store's age grows while no keeper confirms it")
            assert requests.get(url + "/readyz", verify=ca, timeout=5).status_code == 200, "still serving its store"
            add_runtime(env, "cache-after-restart")
            second = keeper(env, store, klog)
            try:
                eventually(lambda: hook.metric("dispatch_admission_runtime_cache_size", kind="ClusterTrainingRuntime")
                           == size + 1, "the new keeper lists into the same store")
                assert hook.metric("dispatch_admission_runtime_keeper_starts_total") == 2
                assert hook.metric("dispatch_admission_runtime_cache_age_seconds", kind="ClusterTrainingRuntime") < 5
                assert mutate(hook, "cache-after-restart")["allowed"]
            finally:
                stop(second)
    finally:
        if first.poll() is None:
            stop(first)


def test_a_local_serve_starts_its_keeper_and_stops_it(env, tmp_path):
    with serve(env, tmp_path / "local", workers=2) as (url, ca, log, proc):
        [pid] = keepers(log)
        assert os.path.exists(f"/proc/{pid}")
    eventually(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
               "the keeper stops with serve")
