"""Hostile input, faults and load against the real server process (loopback only, bounded)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest
import requests
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from tests.bypass import cases, mount_patch, publish_mounts
from tests.helpers import CREDS, ROUTE1, admission, mutated, review, trainjob
from tests.strategies import trainjobs
from webhook.core import patch

CORE = admission({**ROUTE1, **CREDS})


@pytest.fixture(scope="module")
def server(serve_module):
    return serve_module("--log-level", "warning")


class Client:
    """One kept connection to the server."""

    def __init__(self, server):
        self.base, self.ca = server.url, server.ca
        self.s = requests.Session()

    def post(self, path, body, content_type="application/json"):
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return self.s.post(self.base + path, data=data, headers={"Content-Type": content_type},
                           verify=self.ca, timeout=15)


def workers(master_pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(master_pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def check_answer(doc, r):
    """A well-formed AdmissionReview for this uid, or a 4xx with a JSON error; never a 5xx."""
    assert r.status_code < 500, r.text[:500]
    body = r.json()
    if r.status_code != 200:
        assert r.status_code in (400, 413, 415) and body["code"] == r.status_code and body["error"]
        return None
    resp = body["response"]  # a 200 means the body was an AdmissionReview with a request and a uid
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    assert resp["uid"] == doc["request"]["uid"] and isinstance(resp["allowed"], bool)
    if not resp["allowed"]:
        assert resp["status"]["code"] in (403, 404, 422, 503) and resp["status"]["message"]
    return resp


# ---- nesting the standard library cannot read and orjson can ----


@pytest.mark.parametrize("depth", [995, 1005, 1015, 1030])
def test_deep_nesting_past_the_standard_librarys_limit_hides_no_mount(server, depth):
    """orjson reads 1,024 levels, json.loads a little under 1,000: bodies in between now reach the rules.
    A mount at /opt/dispatch beside such a structure is still refused by S2 (or the structure as nested too
    deeply), never admitted and never a 5xx; past 1,024 the body is refused as not JSON (400)."""
    c = Client(server)
    job = trainjob(patches=[mutated(CORE, trainjob())["spec"]["runtimePatches"][0], mount_patch("/opt/dispatch")])
    job["spec"]["trainer"] = {"resourcesPerNode": {"claims": ["@@DEEP@@"]}}
    doc = review(job)
    body = json.dumps(doc).replace('"@@DEEP@@"', "[" * depth + "1" + "]" * depth)
    for path in ("/validate", "/mutate"):
        resp = check_answer(doc, c.post(path, body))
        if depth < 1024 - 8:  # the review's own levels above the claims list
            assert resp is not None and not resp["allowed"], f"{path} at depth {depth}"
            assert re.search(r"reserved for the publish mount|nested too deeply",
                             resp["status"]["message"]), resp["status"]
        else:
            assert resp is None


@pytest.mark.parametrize("path", ["/mutate", "/validate", "/runtimes"])
def test_an_envelope_nested_past_the_standard_librarys_limit_is_a_400(server, path):
    """A field of the envelope the webhook prints (apiVersion, operation, and the request's name where the
    object has none) nested 1,005 deep: a broken request (400), as when the standard library could not
    read it, never a 500."""
    c = Client(server)
    doc = review(trainjob())
    for field in ("apiVersion", "operation", "name"):
        broken = json.loads(json.dumps(doc))
        (broken if field == "apiVersion" else broken["request"])[field] = "@@DEEP@@"
        broken["request"]["object"]["metadata"].pop("name", None)
        body = json.dumps(broken).replace('"@@DEEP@@"', "[" * 1005 + "]" * 1005)
        r = c.post(path, body)
        if field == "name" and path == "/runtimes":  # a TrainJob is no runtime: its name is never printed
            assert r.status_code == 200, r.text[:200]
            continue
        assert r.status_code == 400 and r.json()["code"] == 400, (field, r.status_code, r.text[:200])


# ---- the bypass catalogue, over HTTPS ----

CATALOGUE = cases(lambda job: mutated(CORE, job))


@pytest.mark.parametrize("name,operation,obj,old,rule", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bypass_catalogue_over_https(server, name, operation, obj, old, rule):
    """Each trick sits beside the computed entry: the server must refuse it as the core does, by its rule."""
    c = Client(server)
    doc = review(obj, operation=operation, old=old)
    v = check_answer(doc, c.post("/validate", doc))
    assert v is not None and v["allowed"] is False, f"the server admitted {name}"
    core = CORE.review(doc, "validate")
    assert v == core[0]["response"], "the server's answer differs from the core's"
    assert rule in {r.rule for r in core[1].reasons} and "S5" not in {r.rule for r in core[1].reasons}
    m = check_answer(doc, c.post("/mutate", doc))
    if m["allowed"] and "patch" in m:
        result = patch.apply(obj, json.loads(base64.b64decode(m["patch"])))
        again = check_answer(doc, c.post("/validate", review(result, operation=operation, old=old)))
        assert again["allowed"], f"the mutation of {name} is not admitted by /validate"
        assert not list(publish_mounts(result)), f"the mutation of {name} leaves a mount at /opt/dispatch"


# ---- fuzzing the endpoints ----

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=25)

envelope_parts = st.fixed_dictionaries({}, optional={
    "apiVersion": st.sampled_from(["admission.k8s.io/v1", "admission.k8s.io/v1beta1", 1, None]),
    "kind": st.sampled_from(["AdmissionReview", "Review", None]),
    "request": st.one_of(json_values, st.fixed_dictionaries(
        {"uid": st.one_of(st.text(max_size=8), st.integers())},
        optional={"operation": st.sampled_from(["CREATE", "UPDATE", "DELETE", 7]),
                  "object": json_values,
                  "resource": json_values})),
})


@st.composite
def review_docs(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:  # a plausible review of a generated TrainJob
        job = draw(trainjobs())
        op = draw(st.sampled_from(["CREATE", "UPDATE"]))
        old = draw(trainjobs()) if op == "UPDATE" else None
        return review(job, operation=op, old=old, uid=f"fuzz-{draw(st.integers(0, 10**9))}",
                      dry_run=draw(st.booleans()))
    if kind == 1:  # a broken envelope
        return draw(envelope_parts)
    if kind == 2:  # valid envelope, junk object
        doc = review({}, uid="fuzz-junk")
        doc["request"]["object"] = draw(json_values)
        return doc
    return draw(json_values)


def assert_no_worker_lost(server) -> None:
    text = server.log.read_text()
    assert "Traceback" not in text and "WORKER TIMEOUT" not in text and "Worker exiting" not in text
    assert len(workers(server.process.pid)) == 2


def test_fuzz_endpoints(server):
    """Generated reviews against both endpoints; afterwards no worker lost (checked here, not by a later test)."""
    c = Client(server)
    cases = []

    @hsettings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None,
               suppress_health_check=[HealthCheck.too_slow])
    @given(doc=review_docs(), endpoint=st.sampled_from(["/mutate", "/validate"]))
    def one(doc, endpoint):
        cases.append(endpoint)
        r = c.post(endpoint, doc)
        resp = check_answer(doc, r)
        if resp and endpoint == "/mutate" and resp["allowed"] and "patch" in resp:
            obj = doc["request"]["object"]
            result = patch.apply(obj, json.loads(base64.b64decode(resp["patch"])))
            again = c.post("/validate", {**doc, "request": {**doc["request"], "object": result}})
            assert again.json()["response"]["allowed"], again.json()["response"].get("status")

    one()
    assert_no_worker_lost(server)
    print(f"\nendpoint fuzzing: {len(cases)} cases, no 5xx, no worker lost")


def test_fuzz_raw_bodies(server):
    c = Client(server)

    @hsettings(max_examples=100, deadline=None)
    @given(body=st.binary(max_size=300),
           ctype=st.sampled_from(["application/json", "text/plain", "application/json; charset=utf-8"]))
    def one(body, ctype):
        r = c.post("/mutate", body, content_type=ctype)
        assert r.status_code in (200, 400, 415) and r.headers["Content-Type"] == "application/json"

    one()
    assert_no_worker_lost(server)


# ---- a worker killed under load ----

def test_worker_killed_under_load(serve):
    server = serve("--log-level", "warning")
    base, ca, proc = server.url, server.ca, server.process
    before = workers(proc.pid)
    body = json.dumps(review(mutated(CORE, trainjob())))
    stop, failures, sent = threading.Event(), [], [0]
    threads_n = 6

    def load():
        s = requests.Session()
        while not stop.is_set():
            try:
                r = s.post(base + "/validate", data=body, headers={"Content-Type": "application/json"},
                           verify=ca, timeout=15)
                if r.status_code != 200 or not r.json()["response"]["allowed"]:
                    failures.append(r.status_code)
            except requests.RequestException as e:
                failures.append(type(e).__name__)
                s = requests.Session()
            sent[0] += 1

    threads = [threading.Thread(target=load) for _ in range(threads_n)]
    for t in threads:
        t.start()
    time.sleep(2)
    victim = sorted(before)[0]
    os.kill(victim, signal.SIGKILL)
    time.sleep(4)
    stop.set()
    for t in threads:
        t.join(20)
    after = workers(proc.pid)
    assert victim not in after and len(after) == 2, "the killed worker was not replaced"
    # Only requests in flight on the killed worker (one per connection it held) may fail.
    assert len(failures) <= threads_n, failures
    assert sent[0] > 100
    print(f"\nworker kill: {sent[0]} requests, {len(failures)} failed (in flight on the killed worker)")


# ---- soak ----

def _rss_kib(pids) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{pid}/status").read()).group(1))
        except (OSError, AttributeError):
            pass
    return total


def test_soak_memory_is_flat(serve, tmp_path):
    wrk = shutil.which("wrk")
    if wrk is None:  # `make test` installs it; this is for a bare pytest run
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], capture_output=True)
        wrk = shutil.which("wrk")
    assert wrk, "wrk is needed for the soak test (apt-get install wrk)"
    target = int(os.environ.get("SOAK_REVIEWS", "50000"))
    script = tmp_path / "review.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f"wrk.body = [==[{json.dumps(review(trainjob()))}]==]\n")
    server = serve("--log-level", "warning")
    base, proc = server.url, server.process
    done, samples = 0, []
    warm_rss = None
    deadline = time.monotonic() + 300  # a bound on the soak's wrk runs, not a wait
    while done < target and time.monotonic() < deadline:
        out = subprocess.run([wrk, "-t2", "-c8", "-d5s", "-s", str(script), base + "/mutate"],
                             capture_output=True, text=True, check=True).stdout
        done += int(re.search(r"(\d+) requests in", out).group(1))
        assert "Non-2xx" not in out and "Socket errors" not in out, out
        rss = _rss_kib(workers(proc.pid))
        samples.append(rss)
        if warm_rss is None and done >= min(10000, target // 5):
            warm_rss = rss
    assert done >= target, f"only {done} reviews in the time allowed"
    growth = samples[-1] - warm_rss
    print(f"\nsoak: {done} reviews; worker RSS {warm_rss // 1024} MiB after warm-up, "
          f"{samples[-1] // 1024} MiB at the end")
    assert growth < max(8 * 1024, warm_rss // 10), f"RSS grew by {growth} KiB: {samples}"
