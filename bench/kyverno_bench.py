"""Section 4 of bench/cluster.py: our webhook against the same rules as Kyverno v1.15.2 policies
(bench/kyverno), on the same API server, in the same run (issue 27). `make bench-kyverno` runs it alone
(`python bench/cluster.py --kyverno-only`); `python bench/cluster.py --kyverno` adds it after sections 1 to 3.

Each engine has a namespace of its own (its webhook configurations select it), so neither is called for the
other's TrainJobs; Trainer's webhooks, registered for every namespace, are called for both. For each
Kyverno mode (`--admissionReports` default true, then false) and each concurrency, N suspended TrainJobs are
created in our namespace and N in Kyverno's, interleaved by level, and the API server's
`apiserver_admission_webhook_admission_duration_seconds` gives each webhook's mean and share ≤5 ms. Each
create is timed on the client as well, against creates in a namespace neither engine sees (the added p50).
Then the resident memory of both with 1 runtime and with 10,000, and the time from start to ready.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

from tests.e2e import kyverno
from tests.e2e.conftest import Webhook, webhooks_swapped
from tests.helpers import EXAMPLES
from tests.process import webhook_server

NAMESPACES = {"ours": "bench-ours", "kyverno": "bench-kyverno", "neither": "bench-neither"}
OURS = {"mutate": "mutate.route1.dispatch.go.phpboyscout.uk", "validate": "validate.route1.dispatch.go.phpboyscout.uk"}
KYVERNOS = {"mutate": kyverno.MUTATE_HOOK, "validate": kyverno.VALIDATE_HOOK}


def process_tree_rss_mib(pid: int) -> float:
    """A process and its children (our gunicorn master and its workers: what a pod's memory counts)."""
    total = kyverno.rss_mib(pid)
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        total += kyverno.rss_mib(int(child))
    return total


def run(stack: contextlib.ExitStack, cluster, tmp: Path, custom, n: int, levels: list[int],
        bench, suite_hooks: list | None, runtimes_now: int, many: int = 10_000) -> list[str]:
    """The section's Markdown lines. `bench` is bench/cluster.py (its histograms, deltas and creates);
    `suite_hooks` are our configurations of sections 1 to 3, taken away meanwhile (they select every namespace)."""
    kyverno.install(cluster)
    for engine, ns in NAMESPACES.items():
        cluster.apply({"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": ns, "labels": {kyverno.ENGINE_LABEL: engine}}})
    if suite_hooks:
        stack.enter_context(webhooks_swapped(cluster, suite_hooks, None))
    started = time.monotonic()
    url, ca, log, proc = stack.enter_context(webhook_server(
        tmp / "beside-kyverno", "--settings", str(EXAMPLES / "settings" / "route1.json"),
        "--kubeconfig", cluster.kubeconfig))
    ours_ready = time.monotonic() - started
    for doc in kyverno.our_configurations(Webhook(url, ca, log, proc)):
        cluster.apply(doc)

    rows, client_rows, memory, ready = [], [], [], [("ours", runtimes_now, ours_ready)]
    for reports in (True, False):
        mode = "default (admissionReports on)" if reports else "--admissionReports=false"
        with kyverno.running(cluster, tmp, admission_reports=reports) as kyv:
            ready.append((f"Kyverno, {mode}", runtimes_now, kyv.ready_s))
            for engine in ("ours", "kyverno", "neither"):
                bench.create_many(custom, f"warm-{engine}-{reports:d}", 50, 4, NAMESPACES[engine])
            for level in levels:
                got, latencies = {}, {}
                for engine, hooks in (("ours", OURS), ("kyverno", KYVERNOS)):
                    before = bench.histograms(cluster)
                    latencies[engine] = bench.create_many(custom, f"{engine}-{reports:d}-c{level}", n, level,
                                                          NAMESPACES[engine])
                    after = bench.histograms(cluster)
                    got |= {(engine, k): bench.delta(before, after, v) for k, v in hooks.items()}
                if level == 1:
                    latencies["neither"] = bench.create_many(custom, f"neither-{reports:d}", n, 1,
                                                             NAMESPACES["neither"])
                    client_rows.append((mode, latencies))
                for verb in ("mutate", "validate"):
                    o, k = got["ours", verb], got["kyverno", verb]
                    rows.append(f"| {mode} | {level} | {verb} | {o['count']:.0f} | {o['mean_ms']:.2f} | "
                                f"{o['under'].get('0.005', 0):.0%} | {k['count']:.0f} | {k['mean_ms']:.2f} | "
                                f"{k['under'].get('0.005', 0):.0%} | {o['mean_ms'] / k['mean_ms']:.2f}× |")
            memory.append((mode, runtimes_now, process_tree_rss_mib(proc.pid), kyv.rss_mib()))

    # Many runtimes (10,000 by default): our cache holds them; Kyverno reads one per review. Memory after a load at 8.
    if runtimes_now < many:
        bench.make_runtimes(custom, runtimes_now, many)
    with kyverno.running(cluster, tmp, admission_reports=True) as kyv:
        ready.append(("Kyverno, default (admissionReports on)", many, kyv.ready_s))
        for engine in ("ours", "kyverno"):
            bench.create_many(custom, f"many-{engine}", n, 8, NAMESPACES[engine])
        memory.append(("default (admissionReports on)", many, process_tree_rss_mib(proc.pid), kyv.rss_mib()))
    started = time.monotonic()
    with webhook_server(tmp / "ready-beside-kyverno", "--settings", str(EXAMPLES / "settings" / "route1.json"),
                        "--kubeconfig", cluster.kubeconfig):
        ready.append(("ours", many, time.monotonic() - started))

    out = ["## 4. Against Kyverno v1.15.2: the same rules as ClusterPolicies (bench/kyverno), same API server", "",
           f"({n} TrainJobs per engine, mode and concurrency; each engine in a namespace of its own; Trainer's "
           "webhooks called for both)", "",
           "| Kyverno mode | concurrency | webhook | ours: admissions | mean ms | ≤5 ms | Kyverno: admissions | "
           "mean ms | ≤5 ms | ours / Kyverno (mean) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|", *rows,
           "", "Create latency on the client at concurrency 1, against creates in a namespace neither engine sees:", "",
           "| Kyverno mode | neither: p50 ms | ours: p50 ms | added | Kyverno: p50 ms | added |",
           "|---|---:|---:|---:|---:|---:|"]
    for mode, lat in client_rows:
        bare = statistics.median(lat["neither"])
        o, k = statistics.median(lat["ours"]), statistics.median(lat["kyverno"])
        out.append(f"| {mode} | {bare:.1f} | {o:.1f} | {o - bare:+.1f} | {k:.1f} | {k - bare:+.1f} |")
    out += ["", "Resident memory after the load (ours: the serve process and its workers, as a pod counts them):", "",
            "| Kyverno mode | runtimes | ours MiB | Kyverno MiB | ours / Kyverno |", "|---|---:|---:|---:|---:|"]
    out += [f"| {mode} | {rts:,} | {o:.0f} | {k:.0f} | {o / k:.2f}× |" for mode, rts, o, k in memory]
    out += ["", "From start to ready (Kyverno: webhooks served, policies Ready and registered for TrainJobs; "
            "ours: `/readyz`, runtime cache synced):", "", "| engine | runtimes | ready after s |", "|---|---:|---:|"]
    out += [f"| {what} | {rts:,} | {s:.1f} |" for what, rts, s in ready]
    return out
