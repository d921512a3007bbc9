"""The admission benchmark: what a review costs in-process, over TLS against a baseline app in the
same run, and in API calls. Run: `python bench/admission.py` (or `make bench`); `--quick` for a short run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers import (  # noqa: E402
    CREDS,
    EXAMPLES,
    ROUTE1,
    ROUTE2,
    admission,
    metric_total,
    mount_patch,
    pod_patch,
    review,
    runtime,
    stock_runtimes,
    trainjob,
)
from tests.process import free_port, stop, wait_https  # noqa: E402
from webhook import certs  # noqa: E402
from webhook.core.runtimes import RuntimeIndex  # noqa: E402


def cases():
    others = [pod_patch(f"example.com/m{i}", {
        "volumes": [{"name": f"v{i}", "emptyDir": {}}],
        "containers": [{"name": "node", "volumeMounts": [{"name": f"v{i}", "mountPath": f"/data/{i}"}]}]})
        for i in range(15)]
    env = [{"name": f"VAR_{i}", "value": "x" * 32} for i in range(128)]
    return {
        "small": (ROUTE1 | CREDS, trainjob()),
        "large (16 entries, 128 env)": (ROUTE1 | CREDS, trainjob(patches=others, env=env)),
        "route 2": (ROUTE2, trainjob(runtime_name="torch-init")),
        "refused": (ROUTE1, trainjob(patches=[mount_patch("/opt/dispatch/x")], env=[{"name": "DISPATCH_A"}])),
    }


def per_review_us(adm, doc, endpoint, budget=0.4) -> float:
    """The best of 7 timed batches, each sized to take about `budget`/7 seconds: on a shared machine
    the slower batches measure the neighbours, not the code."""
    adm.review(doc, endpoint)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        adm.review(doc, endpoint)
        n += 1
    batch = max(20, int(n * budget / 7 / 0.05))
    samples = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(batch):
            adm.review(doc, endpoint)
        samples.append((time.perf_counter() - t) / batch * 1e6)
    return min(samples)


def core_table(budget: float) -> list[str]:
    from webhook.core import patch

    rows = ["| TrainJob | mutate µs | validate µs |", "|---|---:|---:|"]
    for name, (settings, job) in cases().items():
        adm = admission(settings)
        m = per_review_us(adm, review(job), "mutate", budget)
        resp, _ = adm.review(review(job), "mutate")
        mutated = job
        if "patch" in resp["response"]:
            import base64
            mutated = patch.apply(job, json.loads(base64.b64decode(resp["response"]["patch"])))
        v = per_review_us(adm, review(mutated), "validate", budget)
        rows.append(f"| {name} | {m:.0f} | {v:.0f} |")
    rows += ["", "| runtimes in the cache | mutate µs (small) |", "|---:|---:|"]
    base = stock_runtimes()
    for n in (1, 100, 10_000):
        index = RuntimeIndex(list(base) +
                             [runtime(name=f"rt-{i}", kind="TrainingRuntime",
                                      namespace=f"ns-{i % 50}") for i in range(n)])
        adm = admission(ROUTE1 | CREDS, runtimes=index)
        rows.append(f"| {n:,} | {per_review_us(adm, review(trainjob()), 'mutate', budget):.0f} |")
    return rows


# ---- the server, over TLS, under wrk ----

def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True, capture_output=True)
        return shutil.which("wrk")
    raise SystemExit("bench: wrk is needed (Debian: apt-get install wrk)")


def lua(body: str) -> str:
    return ('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = [==[{body}]==]\n")


def parse_wrk(text: str) -> dict:
    def ms(value: str) -> float:
        m = re.fullmatch(r"([\d.]+)(us|ms|s)", value)
        return float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)]

    dist = dict(re.findall(r"^\s+(50|90|99)%\s+(\S+)$", text, re.M))
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", text))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),
            "p50": ms(dist["50"]), "p90": ms(dist["90"]), "p99": ms(dist["99"]),
            "errors": errors + (int(non2xx.group(1)) if non2xx else 0)}


def run_wrk(wrk: str, url: str, script: Path, connections: int, seconds: int) -> dict:
    got = subprocess.run([wrk, f"-t{min(2, connections)}", f"-c{connections}", f"-d{seconds}s", "--latency",
                          "--timeout", "10s", "-s", str(script), url], capture_output=True, text=True, check=True)
    return parse_wrk(got.stdout)


ROUNDS = 5


def median_of(runs: list[dict]) -> dict:
    return {k: (sum(r[k] for r in runs) if k == "errors" else statistics.median(r[k] for r in runs)) for k in runs[0]}


def start(cmd: list[str], tmp: Path, name: str, port: int, cert_dir: Path):
    log = tmp / f"{name}.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": ""})
    wait_https(f"https://127.0.0.1:{port}/readyz", str(cert_dir / "ca.crt"), proc, log)
    return proc


def server_table(seconds: int, levels: list[int]) -> list[str]:
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="dispatch-bench-"))
    cert_dir = tmp / "certs"
    certs.write_dev_pair(cert_dir, ["localhost", "127.0.0.1"])
    script = tmp / "review.lua"
    script.write_text(lua(json.dumps(review(trainjob()))))
    ours_port, base_port = free_port(), free_port()
    runtimes = [a for p in sorted((EXAMPLES / "runtimes").glob("*.yaml")) for a in ("--runtime", str(p))]
    ours = start([sys.executable, "-m", "webhook", "serve", "--settings", str(EXAMPLES / "settings" / "route1.json"),
                  "--cert-dir", str(cert_dir), "--bind", f"127.0.0.1:{ours_port}", *runtimes], tmp, "webhook",
                 ours_port, cert_dir)
    try:
        baseline = start([sys.executable, str(ROOT / "bench" / "baseline.py"), "--cert-dir", str(cert_dir),
                          "--bind", f"127.0.0.1:{base_port}"], tmp, "baseline", base_port, cert_dir)
    except BaseException:
        stop(ours)
        raise
    rows = ["| connections | app | requests/s | p50 ms | p90 ms | p99 ms | errors | throughput vs baseline "
            "| p99 vs baseline |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    try:
        for c in levels:
            # Warm both, then alternate rounds of each at the same level and keep the medians: the
            # machine's speed drifts within a run, and alternating exposes both apps to the drift alike.
            run_wrk(wrk, f"https://127.0.0.1:{ours_port}/mutate", script, c, 2)
            run_wrk(wrk, f"https://127.0.0.1:{base_port}/mutate", script, c, 2)
            rounds: dict[str, list[dict]] = {"baseline": [], "ours": []}
            for _ in range(ROUNDS):
                rounds["baseline"].append(run_wrk(wrk, f"https://127.0.0.1:{base_port}/mutate", script, c, seconds))
                rounds["ours"].append(run_wrk(wrk, f"https://127.0.0.1:{ours_port}/mutate", script, c, seconds))
            a, b = (median_of(rounds[k]) for k in ("baseline", "ours"))
            rows.append(f"| {c} | baseline | {a['rps']:.0f} | {a['p50']:.2f} | {a['p90']:.2f} | {a['p99']:.2f} |"
                        f" {a['errors']} | | |")
            rows.append(f"| {c} | dispatch-admission | {b['rps']:.0f} | {b['p50']:.2f} | {b['p90']:.2f} |"
                        f" {b['p99']:.2f} |"
                        f" {b['errors']} | {b['rps'] / a['rps']:.0%} | {b['p99'] / a['p99']:.2f}× |")
    finally:
        stop(ours)
        stop(baseline)
    return rows


# ---- one review at a time, with idle gaps: the API server at concurrency 1 ----

class Client:
    """One kept-alive TLS connection sending one request at a time, as little client code as can be: the request's
    bytes made once, the answer read to its Content-Length."""

    def __init__(self, port: int, ca: Path, path: str, body: bytes):
        import socket
        import ssl

        context = ssl.create_default_context(cafile=str(ca))
        self.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1")
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    def send(self) -> bytes:
        self.sock.sendall(self.request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += self.sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
        while len(body) < length:
            body += self.sock.recv(65536)
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"bench: answered {head[:40]!r}")
        return body


def spaced(n: int, gap: float, verb: str) -> list[str]:
    """Ours (`serve`, route 1, the stock runtimes) and bench/baseline.py --patch (answering our patch), each review
    sent alone after `gap` seconds idle, the two apps alternating; the mean latency of each and their ratio."""
    import base64

    from webhook.commands.files import load_runtimes, load_settings
    from webhook.core.admission import Admission

    tmp = Path(tempfile.mkdtemp(prefix="dispatch-bench-spaced-"))
    cert_dir = tmp / "certs"
    certs.write_dev_pair(cert_dir, ["localhost", "127.0.0.1"])
    doc = review(trainjob(name="floor", namespace="bench", suspend=True))
    runtimes = [a for p in sorted((EXAMPLES / "runtimes").glob("*.yaml")) for a in ("--runtime", str(p))]
    ours_settings = str(EXAMPLES / "settings" / "route1.json")  # the patch `serve` answers with them, as bench/cluster
    answer = Admission(load_settings(ours_settings), load_runtimes(runtimes[1::2])).review(doc, "mutate")[0]["response"]
    (tmp / "our-patch.json").write_bytes(base64.b64decode(answer["patch"]))
    body = json.dumps(doc).encode()
    if verb == "validate":  # the object as our mutation left it, as the API server sends it to validate
        from webhook.core import patch
        doc = review(patch.apply(doc["request"]["object"], json.loads(base64.b64decode(answer["patch"]))))
        body = json.dumps(doc).encode()
    ours_port, base_port = free_port(), free_port()
    ours = start([sys.executable, "-m", "webhook", "serve", "--settings", ours_settings, "--cert-dir", str(cert_dir),
                  "--bind", f"127.0.0.1:{ours_port}", *runtimes], tmp, "webhook", ours_port, cert_dir)
    try:
        baseline = start([sys.executable, str(ROOT / "bench" / "baseline.py"), "--cert-dir", str(cert_dir),
                          "--bind", f"127.0.0.1:{base_port}", "--patch", str(tmp / "our-patch.json")],
                         tmp, "baseline", base_port, cert_dir)
    except BaseException:
        stop(ours)
        raise
    try:
        clients = {"ours": Client(ours_port, cert_dir / "ca.crt", f"/{verb}", body),
                   "floor": Client(base_port, cert_dir / "ca.crt", f"/{verb}", body)}
        for name, client in clients.items():  # both admit it: neither answers a refusal
            assert b'"allowed":true' in client.send(), f"{name} refused the {verb} review"
        times: dict[str, list[int]] = {"ours": [], "floor": []}
        for i in range(n + 200):  # the first 200 warm up (each worker of each app reached)
            for name in (("ours", "floor") if i % 2 else ("floor", "ours")):
                time.sleep(gap)
                t = time.perf_counter_ns()
                clients[name].send()
                if i >= 200:
                    times[name].append(time.perf_counter_ns() - t)
    finally:
        stop(ours)
        stop(baseline)
    mean = {k: statistics.fmean(v) / 1000 for k, v in times.items()}
    p50 = {k: statistics.median(v) / 1000 for k, v in times.items()}
    return [f"| {verb} | {n:,} | {gap * 1000:g} | {mean['ours']:.0f} | {mean['floor']:.0f} | "
            f"**{mean['ours'] / mean['floor']:.2f}×** | {p50['ours']:.0f} | {p50['floor']:.0f} | "
            f"{p50['ours'] / p50['floor']:.2f}× |"]


# ---- API calls per review, against the end-to-end API server ----

def api_calls(reviews: int) -> list[str]:
    import requests

    from tests.e2e import toolchain
    from tests.e2e.cluster import ControlPlane
    from tests.process import webhook_server

    tmp = Path(tempfile.mkdtemp(prefix="dispatch-bench-api-"))
    cluster = ControlPlane(tmp / "cp")
    try:
        cluster.start()
        cluster.install_crds(toolchain.trainer_crds())
        cluster.kubectl("apply", "-f", str(EXAMPLES / "runtimes" / "torch-distributed.yaml"))
        with webhook_server(tmp / "hook", "--settings", str(EXAMPLES / "settings" / "route1.json"),
                            "--kubeconfig", cluster.kubeconfig,
                            env={"PROMETHEUS_MULTIPROC_DIR": ""}) as (url, ca, _, _):
            s = requests.Session()
            body = json.dumps(review(trainjob()))

            def calls() -> float:
                text = s.get(url + "/metrics", verify=ca, timeout=5).text
                return metric_total(text, "dispatch_admission_api_requests_total")

            for _ in range(50):  # warm-up: every worker has listed and watched
                s.post(url + "/mutate", data=body, headers={"Content-Type": "application/json"}, verify=ca)
            before = calls()
            for _ in range(reviews):
                r = s.post(url + "/mutate", data=body, headers={"Content-Type": "application/json"}, verify=ca)
                assert r.json()["response"]["allowed"]
            after = calls()
    finally:
        cluster.stop()
    return ["| reviews (steady state) | API calls | calls per review |", "|---:|---:|---:|",
            f"| {reviews:,} | {after - before:.0f} | {(after - before) / reviews:.3f} |"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="short runs (about a minute in all)")
    p.add_argument("--seconds", type=int, default=None, help="wrk duration per measurement")
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--skip-core", action="store_true")
    p.add_argument("--levels", default="2,8,64", help="wrk connection counts")
    p.add_argument("--skip-api", action="store_true", help="skip the API-call count (it starts kube-apiserver)")
    p.add_argument("--spaced", type=int, metavar="N", default=0,
                   help="only: N reviews one at a time with --gap ms idle before each, ours against bench/baseline.py"
                        " --patch, alternating (as the API server sends them at concurrency 1)")
    p.add_argument("--gap", type=float, default=2.0, help="--spaced: ms idle before each review (default 2)")
    args = p.parse_args()
    if args.spaced:
        print(f"# one review at a time, {time.strftime('%Y-%m-%d')}, load average {os.getloadavg()[0]:.2f}\n")
        print("| path | reviews each | gap ms | ours mean µs | floor mean µs | ours / floor (mean) | ours p50 µs "
              "| floor p50 µs | ours / floor (p50) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for verb in ("mutate", "validate"):
            print("\n".join(spaced(args.spaced, args.gap / 1000, verb)))
        return 0
    seconds = args.seconds or (3 if args.quick else 8)
    print(f"# dispatch-admission benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()},"
          f" {os.cpu_count()} cores, Python {platform.python_version()}\n")
    if not args.skip_core:
        print("## 1. Core cost per review (in-process, best of 7 batches)\n")
        print("\n".join(core_table(0.2 if args.quick else 0.6)) + "\n")
    if not args.skip_server:
        from webhook.serving.gunicorn_config import DEFAULTS

        tuned = os.environ.get("GUNICORN_CMD_ARGS")
        shape = (f"GUNICORN_CMD_ARGS={tuned!r}" if tuned
                 else f"{DEFAULTS['workers']} workers, {DEFAULTS['threads']} app threads each")
        print(f"## 2. Server over TLS (gunicorn, webhook.serving.worker.Worker, {shape}), wrk on the same machine:"
              f" median of {ROUNDS} alternating {seconds} s runs per app and level\n")
        print("\n".join(server_table(seconds, [int(n) for n in args.levels.split(",")])) + "\n")
    if not args.skip_api:
        print("## 3. Kubernetes API calls per review in steady state (runtime watch cache)\n")
        print("\n".join(api_calls(200 if args.quick else 1000)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
