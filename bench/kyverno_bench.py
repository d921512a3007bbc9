"""Section 4 of bench/cluster.py: our webhook against the same rules as Kyverno v1.15.2 policies
(bench/kyverno) and as in-tree admission policies (bench/cel: a ValidatingAdmissionPolicy and a
MutatingAdmissionPolicy, v1), on the same API server, in the same run (issues 27 and 37). `make
bench-kyverno` runs it alone (`python bench/cluster.py --kyverno-only`); `python bench/cluster.py --kyverno`
adds it after sections 1 to 3; `--no-kyverno` leaves Kyverno out (ours against the in-tree policies only).

Each engine has a namespace of its own (its webhook configurations or policy bindings select it), so none is
called for another's TrainJobs; Trainer's webhooks, registered for every namespace, are called for all. For
each Kyverno mode (`--admissionReports` default true, then false) and each concurrency, N suspended TrainJobs
are created in each engine's namespace and in one no engine sees, interleaved by level. The API server's
`apiserver_admission_webhook_admission_duration_seconds` gives each webhook's mean and share ≤5 ms; the
in-tree policies run inside the API server and have no webhook call to time, so every engine is also timed
on the client, against the creates no engine sees (the added p50). Then the memory of each engine as a pod's
cgroup counts it (bench/cluster.py's `pod_memory_mib`; the in-tree policies: the API server's own growth when
they are installed), with 1 runtime and with 10,000, and the time from start to ready.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

from tests.e2e import cel, kyverno
from tests.e2e.webhooks import Webhook, webhooks_swapped
from tests.helpers import EXAMPLES, trainjob
from tests.process import webhook_server

NAMESPACES = {"ours": "bench-ours", "kyverno": "bench-kyverno", "cel": "bench-cel", "neither": "bench-neither"}
OURS = {"mutate": "mutate.route1.dispatch.go.phpboyscout.uk", "validate": "validate.route1.dispatch.go.phpboyscout.uk"}
KYVERNOS = {"mutate": kyverno.MUTATE_HOOK, "validate": kyverno.VALIDATE_HOOK}
LABELS = {"ours": "ours", "kyverno": "Kyverno", "cel": "VAP/MAP", "neither": "no engine"}


def _note(line: str) -> None:
    """Progress on stderr: a long run that fails late still says what it measured."""
    print(line, file=sys.stderr, flush=True)


def _p50(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "-"


def _timed_creates(custom, prefix: str, namespace: str, count: int) -> tuple[list[float], int]:
    """`count` creates one after the other: the latencies (ms) of those that finished, and how many failed
    (a timeout: the API server gives up on a request after 60 s); stops at the first failure."""
    done = []
    for i in range(count):
        job = trainjob(name=f"{prefix}-{i}", namespace=namespace, suspend=True)
        started = time.perf_counter()
        try:
            custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", job,
                                                   _request_timeout=120)
        except Exception as exc:  # noqa: BLE001 - a timeout is the measurement
            _note(f"{prefix}-{i}: failed after {time.perf_counter() - started:.1f} s: {str(exc)[:200]}")
            return done, 1
        done.append(1000 * (time.perf_counter() - started))
    return done, 0


def run(stack: contextlib.ExitStack, cluster, tmp: Path, custom, n: int, levels: list[int],
        bench, suite_hooks: list | None, runtimes_now: int, many: int = 10_000, with_kyverno: bool = True) -> list[str]:
    """The section's Markdown lines. `bench` is bench/cluster.py (its histograms, deltas, creates and memory);
    `suite_hooks` are our configurations of sections 1 to 3, taken away meanwhile (they select every namespace)."""
    if with_kyverno:
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
    # The in-tree policies' memory is the API server's: its growth from installing them (compiled
    # expressions, the runtimes' param informers), settled, no TrainJob created in between.
    apiserver = cluster.apiserver_proc.pid
    time.sleep(5)
    before_cel = bench.pod_memory_mib(apiserver)
    started = time.monotonic()
    cel.install(cluster, NAMESPACES["cel"])
    cel_ready = time.monotonic() - started
    time.sleep(5)
    cel_memory = [("installed, before the load", runtimes_now, bench.pod_memory_mib(apiserver) - before_cel)]

    rows, client_rows, memory = [], [], []
    ready = [("ours", runtimes_now, ours_ready), ("VAP/MAP (enforced after kubectl apply)", runtimes_now, cel_ready)]
    modes = [True, False] if with_kyverno else [None]
    for reports in modes:
        tag = {True: "1", False: "0", None: "x"}[reports]  # in TrainJob names
        mode = ("default (admissionReports on)" if reports else "--admissionReports=false") if with_kyverno else "-"
        running = kyverno.running(cluster, tmp, admission_reports=reports) if with_kyverno else contextlib.nullcontext()
        with running as kyv:
            if kyv is not None:
                ready.append((f"Kyverno, {mode}", runtimes_now, kyv.ready_s))
            engines = ["ours", "cel", *(["kyverno"] if kyv else [])]
            for engine in [*engines, "neither"]:
                bench.create_many(custom, f"warm-{engine}-{tag}", 50, 4, NAMESPACES[engine])
            for level in levels:
                got, latencies = {}, {}
                for engine in [*engines, "neither"]:
                    before = bench.histograms(cluster)
                    latencies[engine] = bench.create_many(custom, f"{engine}-{tag}-c{level}", n, level,
                                                          NAMESPACES[engine])
                    after = bench.histograms(cluster)
                    hooks = {"ours": OURS, "kyverno": KYVERNOS}.get(engine, {})
                    got |= {(engine, k): bench.delta(before, after, v) for k, v in hooks.items()}
                client_rows.append((mode, level, latencies))
                medians = ", ".join(f"{e} p50 {statistics.median(v):.1f}" for e, v in latencies.items())
                _note(f"{mode} c{level}: {medians}")
                if kyv is None:
                    continue
                for verb in ("mutate", "validate"):
                    o, k = got["ours", verb], got["kyverno", verb]
                    rows.append(f"| {mode} | {level} | {verb} | {o['count']:.0f} | {o['mean_ms']:.2f} | "
                                f"{o['under'].get('0.005', 0):.0%} | {k['count']:.0f} | {k['mean_ms']:.2f} | "
                                f"{k['under'].get('0.005', 0):.0%} | {o['mean_ms'] / k['mean_ms']:.2f}× |")
            memory.append((mode, runtimes_now, bench.pod_memory_mib(proc.pid),
                           bench.pod_memory_mib(kyv.proc.pid) if kyv else float("nan")))
    cel_memory.append(("after the load", runtimes_now, bench.pod_memory_mib(apiserver) - before_cel))
    _note(f"API server growth: {cel_memory}")

    # Many runtimes: every one is a param of the in-tree policies, which are evaluated once per param, so
    # their create latency is measured as the runtimes grow (a few creates each: a create may time out).
    scaling = []
    for count in sorted({c for c in (100, 1000, many) if runtimes_now < c <= many}):
        before_many, previous = bench.pod_memory_mib(apiserver), runtimes_now
        bench.make_runtimes(custom, runtimes_now, count)
        runtimes_now = count
        time.sleep(5)
        creates = 3 if count < many else 2
        scaling.append((count, _timed_creates(custom, f"scale-cel-{count}", NAMESPACES["cel"], creates),
                        _timed_creates(custom, f"scale-neither-{count}", NAMESPACES["neither"], 3)))
        _note(f"{count} runtimes: VAP/MAP {scaling[-1][1]}, no engine {scaling[-1][2]}")
        if count == many:
            cel_memory.append((f"growth from {count - previous:,} more runtimes (not the policies' alone)",
                               many, bench.pod_memory_mib(apiserver) - before_many))
    # Ours holds the runtimes in its cache; Kyverno reads one per review. Create latency at 1, memory after a
    # load at 8 (the in-tree policies left out: see the scaling table).
    running = kyverno.running(cluster, tmp, admission_reports=True) if with_kyverno else contextlib.nullcontext()
    with running as kyv:
        if kyv is not None:
            ready.append(("Kyverno, default (admissionReports on)", many, kyv.ready_s))
        latencies = {}
        for engine in ["ours", *(["kyverno"] if kyv else []), "neither"]:
            bench.create_many(custom, f"many-warm-{engine}", 10, 1, NAMESPACES[engine])
            latencies[engine] = bench.create_many(custom, f"many-{engine}", n, 1, NAMESPACES[engine])
        _note(f"{many} runtimes: " + ", ".join(f"{e} p50 {statistics.median(v):.1f}" for e, v in latencies.items()))
        many_rows = [(f"{many:,} runtimes" + (", default (admissionReports on)" if kyv else ""), latencies)]
        for engine in ("ours", *(["kyverno"] if kyv else [])):
            bench.create_many(custom, f"many-c8-{engine}", n, 8, NAMESPACES[engine])
        memory.append(("default (admissionReports on)" if kyv else "-", many, bench.pod_memory_mib(proc.pid),
                       bench.pod_memory_mib(kyv.proc.pid) if kyv else float("nan")))
    started = time.monotonic()
    with webhook_server(tmp / "ready-beside-kyverno", "--settings", str(EXAMPLES / "settings" / "route1.json"),
                        "--kubeconfig", cluster.kubeconfig):
        ready.append(("ours", many, time.monotonic() - started))

    others = "Kyverno v1.15.2 and the in-tree policies" if with_kyverno else "the in-tree policies (Kyverno not run)"
    out = [f"## 4. Against {others}: the same rules as ClusterPolicies (bench/kyverno) and as a "
           "ValidatingAdmissionPolicy and a MutatingAdmissionPolicy (bench/cel), same API server", "",
           f"({n} TrainJobs per engine, mode and concurrency; each engine in a namespace of its own; Trainer's "
           "webhooks called for all)", ""]
    if rows:
        out += ["| Kyverno mode | concurrency | webhook | ours: admissions | mean ms | ≤5 ms | Kyverno: admissions | "
                "mean ms | ≤5 ms | ours / Kyverno (mean) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
                *rows, ""]
    engines = ["ours", "cel", *(["kyverno"] if with_kyverno else [])]
    out += ["Create latency on the client, p50 ms, and what each engine adds to the creates no engine sees (same "
            "level, same phase):", "",
            "| Kyverno mode | concurrency | no engine | " + " | ".join(f"{LABELS[e]} | added" for e in engines) + " |",
            "|---|---:|---:|" + "---:|---:|" * len(engines)]
    for mode, level, lat in client_rows:
        bare = statistics.median(lat["neither"])
        p50 = {e: statistics.median(lat[e]) for e in engines}
        cells = " | ".join(f"{p50[e]:.1f} | {p50[e] - bare:+.1f}" for e in engines)
        out.append(f"| {mode} | {level} | {bare:.1f} | {cells} |")
    for mode, lat in many_rows:
        bare = statistics.median(lat["neither"])
        cells = " | ".join(f"{statistics.median(lat[e]):.1f} | {statistics.median(lat[e]) - bare:+.1f}"
                           if e in lat else "below | -" for e in engines)
        out.append(f"| {mode} | 1 | {bare:.1f} | {cells} |")
    out += ["", "The in-tree policies as the runtimes grow (each binding takes every runtime as a param; creates at "
            "concurrency 1, p50 ms of those that finished, and how many timed out):", "",
            "| runtimes | VAP/MAP p50 ms | VAP/MAP timed out | no engine p50 ms |", "|---:|---:|---:|---:|"]
    for count, (cel_ms, cel_failed), (bare_ms, _) in scaling:
        out.append(f"| {count:,} | {_p50(cel_ms)} | {cel_failed} of {len(cel_ms) + cel_failed} | {_p50(bare_ms)} |")
    out += ["", f"Memory after the load ({bench.MEMORY_HOW}; ours: the serve process and its workers):", ""]
    if with_kyverno:
        out += ["| Kyverno mode | runtimes | ours MiB | Kyverno MiB | ours / Kyverno |", "|---|---:|---:|---:|---:|"]
        out += [f"| {mode} | {rts:,} | {o:.0f} | {k:.0f} | {o / k:.2f}× |" for mode, rts, o, k in memory]
    else:
        out += ["| runtimes | ours MiB |", "|---:|---:|"] + [f"| {rts:,} | {o:.0f} |" for _, rts, o, _ in memory]
    out += ["", "The in-tree policies live in the API server: its memory growth (same measure), the only share "
            "one can see:", "", "| when | runtimes | API server growth MiB |", "|---|---:|---:|"]
    out += [f"| {what} | {rts:,} | {mib:+.0f} |" for what, rts, mib in cel_memory]
    out += ["", "From start to ready (Kyverno: webhooks served, policies Ready and registered for TrainJobs; "
            "ours: `/readyz`, runtime cache synced; VAP/MAP: from `kubectl apply` to both enforced):", "",
            "| engine | runtimes | ready after s |", "|---|---:|---:|"]
    out += [f"| {what} | {rts:,} | {s:.1f} |" for what, rts, s in ready]
    return out
