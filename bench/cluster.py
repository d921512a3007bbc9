"""Admission latency as the API server measures it: our webhooks beside Kubeflow Trainer's own, on one
kube-apiserver, in one run (issue 15). Run: `python bench/cluster.py` (or `make bench-cluster`).

The cluster is the end-to-end suite's: etcd and kube-apiserver v1.37.2, Trainer v2.3.0's CRDs, its
controller manager (its webhooks registered by URL) and our webhook processes registered by URL. For
each concurrency it creates N suspended TrainJobs through the API server with the Python client
(loopback only, a bounded loop), reads the API server's `/metrics` before and after, and reports per
webhook the mean of `apiserver_admission_webhook_admission_duration_seconds` (the histogram's sum/count
delta: exact, where its buckets are not) with the share under each bucket bound, and the ratios ours
/ Trainer's. Each create is also timed on the client. The same run measures the create latency with
our webhooks unregistered (the cost a user pays for them), and, with ours unregistered, the floors a
webhook that does no work sits on, each registered alone where ours sits (a Go one, a Python one on our
worker, and each of them answering with our patch: what applying it costs the API server, and the best a
webhook adding the entry can score in Go and in Python), the webhook's resident memory per worker,
and the time from `serve` to ready with 1, 1,000 and 10,000 runtimes in the API server (right after
they are created, and again once the control plane has settled).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tests.e2e import toolchain  # noqa: E402
from tests.e2e.conftest import start_cluster  # noqa: E402
from tests.e2e.trainer import start_trainer, trainer_webhooks  # noqa: E402
from tests.e2e.webhooks import start_our_webhooks, webhooks_swapped  # noqa: E402
from tests.helpers import EXAMPLES, metric_table, review, trainjob  # noqa: E402
from tests.process import stop, webhook_server  # noqa: E402

NS = "bench"
METRIC = "apiserver_admission_webhook_admission_duration_seconds"
OURS = {"mutate": "mutate.route1.dispatch.go.phpboyscout.uk", "validate": "validate.route1.dispatch.go.phpboyscout.uk"}
TRAINERS = {"mutate": "defaulter.trainjob.trainer.kubeflow.org", "validate": "validator.trainjob.trainer.kubeflow.org"}


def histograms(cluster) -> dict[str, dict]:
    """Per webhook: {"sum", "count", "buckets": {le: cumulative count}}, summed over operation and type."""
    out: dict[str, dict] = {}
    for (name, pairs), value in metric_table(cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout).items():
        part, labels = name.removeprefix(METRIC + "_"), dict(pairs)
        if part not in ("sum", "count", "bucket") or name != f"{METRIC}_{part}":
            continue
        h = out.setdefault(labels.get("name", ""), {"sum": 0.0, "count": 0.0, "buckets": {}})
        if part == "bucket":
            h["buckets"][labels["le"]] = h["buckets"].get(labels["le"], 0.0) + value
        else:
            h[part] += value
    return out


def delta(before: dict, after: dict, name: str) -> dict:
    b = before.get(name, {"sum": 0.0, "count": 0.0, "buckets": {}})
    a = after.get(name, {"sum": 0.0, "count": 0.0, "buckets": {}})
    count = a["count"] - b["count"]
    return {"count": count, "mean_ms": 1000 * (a["sum"] - b["sum"]) / count if count else float("nan"),
            "under": {le: (v - b["buckets"].get(le, 0.0)) / count if count else float("nan")
                      for le, v in a["buckets"].items()}}


def api(cluster, pool: int):
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=cluster.kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = pool
    return client.CustomObjectsApi(client.ApiClient(cfg))


DISTINCT = False  # --distinct: each TrainJob's spec its own (an env value), so none is answered from a kept answer


def create_many(custom, prefix: str, n: int, concurrency: int, namespace: str = NS) -> list[float]:
    """Create n suspended TrainJobs at a fixed concurrency; each create's latency in ms, as the client saw it."""
    def one(i: int) -> float:
        job = trainjob(name=f"{prefix}-{i}", namespace=namespace, suspend=True)
        if DISTINCT:
            job["spec"].setdefault("trainer", {}).setdefault("env", []).append({"name": "RUN_INDEX", "value": str(i)})
        started = time.perf_counter()
        custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", job)
        return 1000 * (time.perf_counter() - started)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


def _proc_mib(path: str, field: str) -> float:
    """A kB figure of a /proc file (status, smaps_rollup), in MiB."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return 0.0


def worker_rss_mib(pid: int) -> list[float]:
    """Resident memory of each child of the serve process: the runtime keeper (started first), then the workers."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [_proc_mib(f"/proc/{child}/status", "VmRSS:") for child in children]


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants (the children of each of its threads, recursively)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # a thread that has just exited
                pass
    return out


def _own_cgroup(pids: list[int]) -> Path | None:
    """The cgroup (v2) the tree is alone in, if it is: then its memory.current is what the kernel charges it."""
    try:
        line = Path(f"/proc/{pids[0]}/cgroup").read_text().splitlines()[0]
        group = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")
        members = {int(p) for p in (group / "cgroup.procs").read_text().split()}
    except (OSError, IndexError, ValueError):
        return None
    return group if members == set(pids) and (group / "memory.current").exists() else None


MEMORY_HOW = "PSS summed over the process tree (the cgroup's memory.current where the tree has a cgroup to itself)"


def pod_memory_mib(pid: int) -> float:
    """A process tree's memory as a pod's cgroup counts it, the same way for every engine: memory.current of
    the cgroup the tree is alone in, else the sum of its processes' PSS, where a page shared after fork (our
    gunicorn master and its workers) counts once across them, not once per process as a sum of RSS does."""
    pids = process_tree(pid)
    group = _own_cgroup(pids)
    if group is not None:
        return int((group / "memory.current").read_text()) / 2**20
    return sum(_proc_mib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)


FLOOR_LEVEL_MAX = 32  # floors are measured at the levels up to this one
FLOOR_HOOKS = {"go": "go.floor.bench.example", "python": "python.floor.bench.example",
               "go-patch": "go-patch.floor.bench.example", "python-patch": "python-patch.floor.bench.example"}


def floors(stack: contextlib.ExitStack, cluster, tmp: Path, custom, n: int, levels: list[int],
           bare: dict[int, list[float]]) -> tuple[list[str], dict]:
    """What a webhook costs the API server when it does no work: a Go one served as Trainer's are
    (bench/nullwebhook), bench/baseline.py on our worker and TLS, and each of them answering with the patch
    our webhook computes for these TrainJobs (what applying that patch costs the API server; the best a
    webhook that adds SPEC 6's entry can do, in Go and in Python on our worker). Each is registered alone
    where ours sits, right after Trainer's defaulter, and measured at each level up to FLOOR_LEVEL_MAX
    beside it; then the Go pair a webhook like ours would be at best (the patching one mutating, the plain
    one validating), for what it adds to a create."""
    from tests.process import free_port, wait_https
    from webhook import certs
    from webhook.commands.files import load_runtimes, load_settings
    from webhook.core.admission import MUTATE, Admission

    levels = [level for level in levels if level <= FLOOR_LEVEL_MAX]
    if not levels:
        return [f"(not measured: floors are measured at the levels up to {FLOOR_LEVEL_MAX})"], {}
    cert_dir = tmp / "floor-certs"
    certs.write_dev_pair(cert_dir, ["localhost", "127.0.0.1"])
    binary = tmp / "nullwebhook"
    toolchain._go(["build", "-o", str(binary), "."], ROOT / "bench" / "nullwebhook")
    stock = toolchain.trainer_module() / "manifests" / "base" / "runtimes" / "torch_distributed.yaml"
    ours = Admission(load_settings(str(EXAMPLES / "settings" / "route1.json")), load_runtimes([str(stock)]))
    answer = ours.review(review(trainjob(name="floor", namespace=NS, suspend=True)), MUTATE)[0]["response"]
    (tmp / "our-patch.json").write_bytes(base64.b64decode(answer["patch"]))

    go = [str(binary), "--cert", str(cert_dir / "tls.crt"), "--key", str(cert_dir / "tls.key")]
    python = [sys.executable, str(ROOT / "bench" / "baseline.py"), "--cert-dir", str(cert_dir)]
    commands = {"go": go, "python": python, "go-patch": go + ["--patch", str(tmp / "our-patch.json")],
                "python-patch": python + ["--patch", str(tmp / "our-patch.json")]}
    urls = {}
    for name in FLOOR_HOOKS:
        port, log = free_port(), tmp / f"floor-{name}.log"
        cmd = commands[name] + ["--bind", f"127.0.0.1:{port}"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        stack.callback(stop, proc)
        urls[name] = f"https://127.0.0.1:{port}"
        wait_https(f"https://127.0.0.1:{port}/healthz", str(cert_dir / "ca.crt"), proc, log)
    bundle = base64.b64encode((cert_dir / "ca.crt").read_bytes()).decode()
    rules = [{"apiGroups": ["trainer.kubeflow.org"], "apiVersions": ["v1alpha1"], "resources": ["trainjobs"],
              "operations": ["CREATE", "UPDATE"], "scope": "*"}]

    def configuration(kind: str, name: str, path: str) -> dict:
        # "zz-": after Trainer's defaulter.trainer.kubeflow.org, where ours sits (mutating ones run in name order)
        return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind, "metadata": {"name": "zz-bench-floor"},
                "webhooks": [{"name": FLOOR_HOOKS[name], "admissionReviewVersions": ["v1"], "sideEffects": "None",
                              "timeoutSeconds": 10, "failurePolicy": "Fail", "rules": rules,
                              "clientConfig": {"url": urls[name] + path, "caBundle": bundle}}]}

    @contextlib.contextmanager
    def registered(label: str, *docs: dict):
        for doc in docs:
            cluster.apply(doc)
        try:
            create_many(custom, f"warm-floor-{label}", 50, 4)
            yield
        finally:
            for doc in docs:
                cluster.kubectl("delete", doc["kind"].lower(), "zz-bench-floor")

    labels = {"go": "Go, no work, no patch (bench/nullwebhook)",
              "python": "Python on our worker and TLS, no work, no patch (bench/baseline.py)",
              "go-patch": "Go, no work, answering our patch",
              "python-patch": "Python on our worker and TLS, no work, answering our patch (bench/baseline.py --patch)"}
    rows, ratios = [], {}
    for name, label in labels.items():
        with registered(name, configuration("MutatingWebhookConfiguration", name, "/mutate")):
            for level in levels:
                before = histograms(cluster)
                create_many(custom, f"floor-{name}-{level}", n, level)
                after = histograms(cluster)
                d, trainers = delta(before, after, FLOOR_HOOKS[name]), delta(before, after, TRAINERS["mutate"])
                ratios[name, level] = d["mean_ms"] / trainers["mean_ms"]
                rows.append(f"| {level} | {label} | {d['count']:.0f} | {d['mean_ms']:.2f} | "
                            f"{d['under'].get('0.005', 0):.0%} | {trainers['mean_ms']:.2f} | "
                            f"{ratios[name, level]:.2f}× |")
    rows += ["", "A webhook that answers our patch and does nothing else is "
             + ", ".join(f"{ratios['go-patch', level]:.2f}× the defaulter at {level}" for level in levels)
             + ": the best any webhook that adds the entry can score in section 1 (phases differ: read each "
               "floor against the defaulter beside it, not against the other floors)."]
    pair = (configuration("MutatingWebhookConfiguration", "go-patch", "/mutate"),
            configuration("ValidatingWebhookConfiguration", "go", "/validate"))
    with registered("pair", *pair):
        for level in levels:
            latencies = create_many(custom, f"floor-pair-{level}", n, level)
            rows.append(f"At {level}, that Go webhook with the plain one as a validating webhook adds "
                        f"{statistics.median(latencies) - statistics.median(bare[level]):+.1f} ms to a create's p50: "
                        f"the best any pair like ours can add in section 2.")
    return rows, ratios


SETTLE = 15.0  # seconds left to the control plane after creating runtimes, for the settled measurement


def make_runtimes(custom, start: int, stop: int) -> None:
    """ClusterTrainingRuntimes bench-rt-START to bench-rt-(STOP-1), copies of the example torch runtime."""
    base = yaml.safe_load((EXAMPLES / "runtimes" / "torch-distributed.yaml").read_text())

    def make(i: int) -> None:
        rt = copy.deepcopy(base)
        rt["metadata"] = {"name": f"bench-rt-{i}"}
        custom.create_cluster_custom_object("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", rt)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(make, range(start, stop)))


def time_to_ready(cluster, tmp: Path, count: int, custom, existing: int) -> tuple[float, float, list[float], float,
                                                                                  int]:
    """Bring the cluster's ClusterTrainingRuntimes up to `count`, then time `serve` from start to ready:
    at once (the API server and Trainer's controller still busy with the creates), and again after
    SETTLE seconds (runtimes that have been there a while: the usual case for a rollout)."""
    make_runtimes(custom, existing, count)
    def serve(label: str) -> tuple[float, list[float], float]:
        started = time.monotonic()
        with webhook_server(tmp / f"ready-{count}-{label}", "--settings", str(EXAMPLES / "settings" / "route1.json"),
                            "--kubeconfig", cluster.kubeconfig) as (_, _, _, proc):
            return time.monotonic() - started, worker_rss_mib(proc.pid), pod_memory_mib(proc.pid)

    at_once, _, _ = serve("at-once")
    time.sleep(SETTLE)
    settled, rss, pod = serve("settled")
    return at_once, settled, rss, pod, count


def section_ready(cluster, tmp: Path, custom, runtime_counts: list[int], existing: int) -> tuple[list[str], int]:
    """Section 3: from `serve` to ready, and the memory of the pod's processes, by runtimes in the API server."""
    out = ["", "## 3. From `serve` to ready, by runtimes in the API server", "",
           f"(at once: started right after the runtimes were created; settled: {SETTLE:.0f} s later)", "",
           "| runtimes | ready after s, at once | ready after s, settled | resident memory per process MiB "
           "(keeper, workers) | pod (serve, keeper and workers, PSS) MiB | runtime cache per pod MiB |",
           "|---:|---:|---:|---:|---:|---:|"]
    pod_base = None
    for count in runtime_counts:
        at_once, settled, rss, pod, existing = time_to_ready(cluster, tmp, count, custom, existing)
        pod_base = pod if pod_base is None else pod_base  # the first count's pod: the baseline
        out.append(f"| {count:,} | {at_once:.1f} | {settled:.1f} | {', '.join(f'{r:.0f}' for r in rss)} | "
                   f"{pod:.0f} | {pod - pod_base:.0f} |")
    return out, existing


def run_ready_only(runtime_counts: list[int]) -> list[str]:
    """Section 3 alone, on a cluster of its own (no Trainer controller, no TrainJobs)."""
    out = [f"# dispatch-admission from serve to ready, {date.today()}, {platform.machine()}, "
           f"{__import__('os').cpu_count()} cores, Python {platform.python_version()}"]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-cluster-")))
        cluster = start_cluster(stack, tmp, toolchain.trainer_crds() + toolchain.jobset_crds())
        return out + section_ready(cluster, tmp, api(cluster, 32), runtime_counts, existing=0)[0]


def run(n: int, levels: list[int], runtime_counts: list[int], kyverno: str = "",
        with_kyverno: bool = True) -> list[str]:
    """kyverno: "" (sections 1 to 3), "also" (then section 4, bench/kyverno_bench.py) or "only" (section 4);
    with_kyverno: False leaves Kyverno out of section 4 (ours against the in-tree policies)."""
    out = [f"# dispatch-admission against Trainer's webhook, {date.today()}, {platform.machine()}, "
           f"{__import__('os').cpu_count()} cores, Python {platform.python_version()}", ""]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-cluster-")))
        cluster = start_cluster(stack, tmp, toolchain.trainer_crds() + toolchain.jobset_crds())
        runtimes = toolchain.trainer_module() / "manifests" / "base" / "runtimes"
        cluster.kubectl("apply", "-f", str(runtimes / "torch_distributed.yaml"))
        cluster.kubectl("create", "namespace", NS)
        proc, port = start_trainer(cluster, tmp)
        stack.callback(stop, proc)
        for doc in trainer_webhooks(port, (tmp / "k8s-webhook-server" / "serving-certs" / "ca.crt").read_bytes()):
            cluster.apply(doc)
        custom = api(cluster, max(levels) * 2)
        if kyverno == "only":
            import kyverno_bench

            return out + kyverno_bench.run(stack, cluster, tmp, custom, n, levels, sys.modules[__name__], None, 1,
                                           max(runtime_counts), with_kyverno=with_kyverno)
        hooks = start_our_webhooks(stack, cluster, tmp)
        create_many(custom, "warm", 50, 4)  # connections, caches and JIT-less warm-up on both sides

        out += ["## 1. Admission duration per webhook, as the API server measures it", "",
                "(Trainer's configurations under the names its manifests give them: the API server calls its "
                "defaulter, then ours, as in a cluster; the validating webhooks are called in parallel)", "",
                "| concurrency | webhook | admissions | mean ms | ≤5 ms | ≤25 ms | ≤100 ms | ours / Trainer's (mean) |",
                "|---:|---|---:|---:|---:|---:|---:|---:|"]
        client_rows, mutate_ratio = [], {}
        for level in levels:
            before = histograms(cluster)
            latencies = create_many(custom, f"c{level}", n, level)
            after = histograms(cluster)
            got = {f"ours {k}": delta(before, after, v) for k, v in OURS.items()}
            got |= {f"Trainer's {'defaulter' if k == 'mutate' else 'validator'}": delta(before, after, v)
                    for k, v in TRAINERS.items()}
            ratio = {"ours mutate": got["ours mutate"]["mean_ms"] / got["Trainer's defaulter"]["mean_ms"],
                     "ours validate": got["ours validate"]["mean_ms"] / got["Trainer's validator"]["mean_ms"]}
            mutate_ratio[level] = ratio["ours mutate"]
            for name, d in got.items():
                under = d["under"]
                out.append(f"| {level} | {name} | {d['count']:.0f} | {d['mean_ms']:.2f} | "
                           f"{under.get('0.005', 0):.0%} | {under.get('0.025', 0):.0%} | {under.get('0.1', 0):.0%} | "
                           f"{f'{ratio[name]:.2f}×' if name in ratio else ''} |")
            client_rows.append((level, latencies))

        with webhooks_swapped(cluster, hooks, None):
            create_many(custom, "warm-bare", 50, 4)
            bare = {level: create_many(custom, f"bare{level}", n, level) for level in levels}
            floor_rows, floor_ratios = floors(stack, cluster, tmp, custom, n, levels, bare)
        out += ["", "## 2. Create latency on the client, with our webhooks registered and without them", "",
                "| concurrency | with: p50 ms | p99 ms | without: p50 ms | p99 ms | added at p50 ms |",
                "|---:|---:|---:|---:|---:|---:|"]
        for level, latencies in client_rows:
            with_p50, bare_p50 = statistics.median(latencies), statistics.median(bare[level])
            out.append(f"| {level} | {with_p50:.1f} | {pct(latencies, 99):.1f} | {bare_p50:.1f} | "
                       f"{pct(bare[level], 99):.1f} | {with_p50 - bare_p50:+.1f} |")
        out += ["", f"Resident memory of our route-1 webhook's workers after the run: "
                f"{', '.join(f'{r:.0f} MiB' for r in worker_rss_mib(hooks[0].process.pid))}."]

        out += ["", "## 2b. Floors: webhooks that do no work, where ours sits (ours unregistered)", "",
                "| concurrency | webhook | admissions | mean ms | ≤5 ms | Trainer's defaulter beside it, ms | "
                "/ defaulter |", "|---:|---|---:|---:|---:|---:|---:|"] + floor_rows
        # Ours and the floor were measured in different phases: each against the defaulter beside it.
        out += ["", "Ours mutate against the Go webhook answering our patch (each / the defaulter beside it): "
                + ", ".join(f"{mutate_ratio[level] / floor_ratios['go-patch', level]:.2f}× at {level}"
                            for level in levels if ("go-patch", level) in floor_ratios) + " (target ≤ 1.10×)."]
        out += ["", "Ours mutate against Python on our worker answering our patch: "
                + ", ".join(f"{mutate_ratio[level] / floor_ratios['python-patch', level]:.2f}× at {level}"
                            for level in levels if ("python-patch", level) in floor_ratios)
                + "; that Python webhook against the Go one, both answering our patch: "
                + ", ".join(f"{floor_ratios['python-patch', level] / floor_ratios['go-patch', level]:.2f}× at {level}"
                            for level in levels if ("python-patch", level) in floor_ratios
                            and ("go-patch", level) in floor_ratios) + "."]

        lines, existing = section_ready(cluster, tmp, custom, runtime_counts, existing=1)  # Trainer's runtime
        out += lines
        if kyverno == "also":
            import kyverno_bench

            out += [""] + kyverno_bench.run(stack, cluster, tmp, custom, n, levels, sys.modules[__name__], hooks,
                                            existing, max(runtime_counts), with_kyverno=with_kyverno)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=1000, help="TrainJobs created per concurrency level (default 1,000)")
    p.add_argument("--levels", default="1,8,32", help="concurrency levels")
    p.add_argument("--runtimes", default="1,1000,10000", help="runtime counts for the time to ready")
    p.add_argument("--quick", action="store_true", help="n=100, runtimes 1 and 1,000")
    p.add_argument("--kyverno", action="store_true",
                   help="then section 4: against Kyverno's policies (bench/kyverno) and the in-tree ones (bench/cel)")
    p.add_argument("--kyverno-only", action="store_true", help="section 4 alone")
    p.add_argument("--no-kyverno", action="store_true",
                   help="section 4 without Kyverno (ours against the in-tree policies)")
    p.add_argument("--ready-only", action="store_true", help="section 3 alone (serve to ready, memory)")
    p.add_argument("--distinct", action="store_true",
                   help="each TrainJob's spec its own (an env value): every review decided in full, none answered"
                        " from a kept answer (webhook.core.answers)")
    args = p.parse_args()
    global DISTINCT
    DISTINCT = args.distinct
    n, counts = (100, "1,1000") if args.quick else (args.n, args.runtimes)
    kyverno = "only" if args.kyverno_only else "also" if args.kyverno else ""
    runtime_counts = [int(x) for x in counts.split(",")]
    lines = run_ready_only(runtime_counts) if args.ready_only else run(
        n, [int(x) for x in args.levels.split(",")], runtime_counts, kyverno, with_kyverno=not args.no_kyverno)
    for line in lines:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
