"""The keeper's store bounded by construction (issue 47): a relist in bounded memory whatever the list's size,
readers that see a list whole, runtime caps in UTF-8 bytes, a full store that keeps what it holds, and a
namespace's share of the store that degrades that namespace alone."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT, admission, answer, review, runtime, sentinels, trainjob
from webhook.core.runtimes import MAX_PATH, MAX_STORED_BYTES, NAMESPACED_KIND, Runtime
from webhook.kube.cluster import ClusterRuntimes
from webhook.kube.store import StoreWriter
from webhook.kube.store_reader import StoreReader

KIND = "ClusterTrainingRuntime"
LIMIT_MIB = 64


def names_of(reader: StoreReader) -> set[str]:
    return {r.name for r in reader}


# ---- a relist in bounded memory ----

RELIST = textwrap.dedent("""
    import json, sys, tempfile
    from tests.helpers import runtime
    from webhook.core.runtimes import Runtime
    from webhook.kube.store import StoreWriter
    from webhook.kube.store_reader import StoreReader

    def rss_anon():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    def at_the_cap(i):  # about 62 KB stored: 1,040 volume names of 59 characters
        return runtime(f"r{i:05d}", kind="TrainingRuntime", namespace="team-a", jobs={"node": {
            "containers": [{"name": "node"}], "volumes": [{"name": f"{i:05d}{j:04d}" + "v" * 50}
                                                          for j in range(1040)]}})

    stored = len(Runtime.of(at_the_cap(0)).to_bytes())
    writer = StoreWriter(tempfile.mkdtemp(), namespace_share=1 << 30)  # no share: the write path alone
    writer.replace("TrainingRuntime", [at_the_cap(0)])
    base = peak = rss_anon()

    def listing(count):
        global peak
        for i in range(count):
            if i % 10 == 0:
                peak = max(peak, rss_anon())
            yield at_the_cap(i)

    writer.replace("TrainingRuntime", listing(int(sys.argv[1])))
    held = writer.replace("TrainingRuntime", listing(int(sys.argv[1])))  # again: the old list's 93 MiB dropped too
    peak = max(peak, rss_anon())
    whole = sum(1 for r in StoreReader("", env=writer.env) if not r.oversize)
    print(json.dumps({"base": base, "peak": peak, "held": held, "whole": whole, "stored": stored}))
""")


def test_a_relist_of_1500_runtimes_at_the_cap_grows_the_process_by_less_than_64_mib():
    """Measured in a child process of its own (RssAnon from /proc/self/status, sampled as the list is written):
    93 MiB of runtimes written in batches of BATCH_BYTES, where one transaction took the process to 220 MiB; then
    listed again, so that the old generation's 93 MiB are dropped as the new one is written."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", RELIST, "1500"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    grown = (got["peak"] - got["base"]) / (1 << 20)
    print(f"1,500 runtimes of {got['stored']:,} B stored, listed twice: RssAnon {got['base'] >> 20}"
          f" -> {got['peak'] >> 20} MiB (+{grown:.1f} MiB)")
    assert got["stored"] > 0.9 * MAX_STORED_BYTES, "each runtime is at the cap"
    assert got["held"] == got["whole"] == 1500
    assert grown < LIMIT_MIB, f"the relist grew the process by {grown:.1f} MiB"


def test_readers_see_the_old_list_or_the_new_whole(tmp_path):
    writer = StoreWriter(str(tmp_path), batch_bytes=2048)  # many batches, each committed
    reader = StoreReader(str(tmp_path), env=writer.env)
    old = {f"old-{i:03d}" for i in range(60)}
    writer.replace(KIND, [runtime(n) for n in sorted(old)])
    seen = []

    def listing():
        for i in range(60):
            seen.append(names_of(reader))
            assert reader.get(KIND, "", f"new-{i - 1:03d}") is None, "a runtime of the list being written"
            yield runtime(f"new-{i:03d}")

    writer.replace(KIND, listing())
    assert all(s == old for s in seen), "the old list, whole, until the new one is switched to"
    assert names_of(reader) == {f"new-{i:03d}" for i in range(60)} and writer.count(KIND) == 60
    assert reader.get(KIND, "", "new-007") is not None and reader.get(KIND, "", "old-007") is None


def test_a_list_that_fails_midway_leaves_the_last_list_and_the_next_drops_its_start(tmp_path):
    writer = StoreWriter(str(tmp_path), batch_bytes=2048)
    reader = StoreReader(str(tmp_path), env=writer.env)
    writer.replace(KIND, [runtime("kept")])

    def failing():
        for i in range(40):
            yield runtime(f"half-{i:02d}")
        raise ConnectionError("the API server went away")

    try:
        writer.replace(KIND, failing())
    except ConnectionError:
        pass
    assert names_of(reader) == {"kept"}
    writer.replace(KIND, [runtime("next")])
    assert names_of(reader) == {"next"}
    with writer.env.begin() as txn:
        runtimes_stored = [k for k, _ in txn.cursor() if not k.startswith(b"\0")]
    assert len(runtimes_stored) == 1, "the half-written list and the old one are dropped"


# ---- every cap in UTF-8 bytes ----

def test_a_runtime_of_4_byte_characters_is_held_to_the_byte_cap():
    """18,000 characters of 4 bytes each are 72,000 bytes: past the 64 KiB cap (counted in characters, as it
    was, they were under it and the runtime stored 242,716 B)."""
    wide = "\U0001d4b3"  # 4 bytes in UTF-8
    over = runtime("wide", jobs={"node": {"containers": [{"name": "node"}],
                                          "volumes": [{"name": f"{i:03d}" + wide * 57} for i in range(300)]}})
    taken = Runtime.of(over)
    assert taken.oversize and f"more than {MAX_STORED_BYTES} bytes" in taken.oversize
    assert len(taken.to_bytes()) < 1024
    under = runtime("wide-under", jobs={"node": {"containers": [{"name": "node"}],
                                                 "volumes": [{"name": f"{i:03d}" + wide * 50} for i in range(300)]}})
    kept = Runtime.of(under)
    assert not kept.oversize and len(kept.to_bytes()) < MAX_STORED_BYTES + 4096
    path = "/data/" + wide * (MAX_PATH // 4)  # 1,024 characters, 4,102 bytes
    mounted = runtime("wide-path", jobs={"node": {"containers": [
        {"name": "node", "volumeMounts": [{"name": "v", "mountPath": path}]}]}})
    assert f"longer than {MAX_PATH} bytes" in Runtime.of(mounted).oversize
    lone = runtime("lone", jobs={"node": {"containers": [{"name": "node"}], "volumes": [{"name": "a\ud800b"}]}})
    assert not Runtime.of(lone).oversize  # a lone surrogate (JSON may carry one) is counted, not a crash


# ---- a full store keeps what it holds ----

def test_a_full_store_keeps_what_it_held_and_says_so(tmp_path, caplog):
    writer = StoreWriter(str(tmp_path), map_size=1 << 20)
    full: list[str] = []
    writer.on_full = full.append
    reader = StoreReader(str(tmp_path), env=writer.env)
    writer.replace(KIND, [runtime("kept")])
    listed = [runtime("kept")] + [runtime(f"{i:05d}-" + "n" * 200) for i in range(20_000)]
    with caplog.at_level(logging.WARNING, logger="webhook.kube.store"):
        held = writer.replace(KIND, listed)
    not_held = writer.not_held[(KIND, "store-full")]
    assert 1 < held < 20_001 and held + not_held == 20_001
    assert reader.get(KIND, "", "kept") is not None, "what fitted is held"
    assert len(reader) == held == writer.count(KIND)
    assert full == [KIND] and f'"not_held": {not_held}' in caplog.text
    before = reader.get(KIND, "", "kept")
    changed = runtime("kept", jobs={"node": {"containers": [{"name": "node"}],
                                             "volumes": [{"name": f"v{i:04d}" + "w" * 50} for i in range(1000)]}})
    writer.put(changed)  # a watch event: held, or (no room) its older version removed; never raises
    writer.put(runtime("late-" + "n" * 200))
    after = reader.get(KIND, "", "kept")
    assert after is None or (after != before and after.jobs[0].volumes), "never the older version in its place"
    assert writer.not_held[(KIND, "store-full")] >= not_held + 1 and len(full) >= 2


# ---- a namespace's share ----

def namespaced(name: str, namespace: str, volumes: int = 0) -> dict:
    return runtime(name, kind=NAMESPACED_KIND, namespace=namespace, jobs={"node": {
        "containers": [{"name": "node"}], "volumes": [{"name": f"{i:04d}" + "v" * 60} for i in range(volumes)]}})


@pytest.mark.rules("R5")
def test_a_namespace_past_its_share_gets_the_documented_answer_and_another_is_admitted(tmp_path):
    each = len(Runtime.of(namespaced("big-0", "team-a", 1000)).to_bytes())  # some 70 KB stored
    share = each * 7 // 2  # three of them, not four
    writer = StoreWriter(str(tmp_path), namespace_share=share)
    writer.replace(KIND, [])
    writer.replace(NAMESPACED_KIND, [namespaced(f"big-{i}", "team-a", 1000) for i in range(5)]
                   + [namespaced("small", "team-b")])
    runtimes = ClusterRuntimes(StoreReader(str(tmp_path), env=writer.env), live=None)
    adm = admission(runtimes=runtimes)
    assert writer.namespace_bytes(NAMESPACED_KIND, "team-a") <= share + 2048
    assert writer.not_held[(NAMESPACED_KIND, "namespace-share")] == 2

    done, outcome = adm.review(review(trainjob(namespace="team-a", runtime_name="big-4", kind=NAMESPACED_KIND)),
                               "mutate")
    refused = done["response"]
    assert not refused["allowed"] and refused["status"]["code"] == 403
    assert sentinels(refused) == ["ErrUnsupported"] and [r.rule for r in outcome.reasons] == ["R5"]
    said = refused["status"]["details"]["causes"][0]["message"]
    held = writer.namespace_bytes(NAMESPACED_KIND, "team-a")
    size = int(re.search(r"its namespace team-a holds ([\d,]+) bytes of TrainingRuntimes", said)[1].replace(",", ""))
    assert share - each < size <= share and size <= held, "the namespace's size, as held"
    assert f"would pass the namespace's share of {share:,} bytes" in said, said
    for allowed in (trainjob(namespace="team-b", runtime_name="small", kind=NAMESPACED_KIND),
                    trainjob(namespace="team-a", runtime_name="big-0", kind=NAMESPACED_KIND)):
        assert answer(adm, allowed)["allowed"], "another namespace, and what the namespace holds in full"


def test_the_share_holds_for_watch_events_and_room_made_is_used(tmp_path):
    writer = StoreWriter(str(tmp_path), namespace_share=150_000)
    reader = StoreReader(str(tmp_path), env=writer.env)
    writer.replace(NAMESPACED_KIND, [namespaced("big-0", "team-a", 1000), namespaced("big-1", "team-a", 1000)])
    writer.put(namespaced("big-2", "team-a", 1000))  # ADDED past the share
    over = reader.get(NAMESPACED_KIND, "team-a", "big-2")
    assert "would pass the namespace's share of 150,000 bytes" in over.oversize
    assert writer.not_held[(NAMESPACED_KIND, "namespace-share")] == 1
    writer.put(namespaced("elsewhere", "team-b", 1000))
    assert not reader.get(NAMESPACED_KIND, "team-b", "elsewhere").oversize, "another namespace's share is its own"
    writer.delete(namespaced("big-0", "team-a"))
    writer.put(namespaced("big-2", "team-a", 1000))  # MODIFIED once there is room: held whole
    assert not reader.get(NAMESPACED_KIND, "team-a", "big-2").oversize
    assert writer.not_held[(NAMESPACED_KIND, "namespace-share")] == 0
    assert writer.namespace_bytes(NAMESPACED_KIND, "team-a") <= 150_000



def test_the_keepers_state_says_what_is_not_held(tmp_path):
    from webhook.kube.keeper import state_of
    from webhook.kube.reflector import ReadStats

    writer = StoreWriter(str(tmp_path), namespace_share=100_000)
    writer.replace(NAMESPACED_KIND, [namespaced(f"big-{i}", "team-a", 1000) for i in range(3)])
    state = state_of(writer, ReadStats(), starts=1, started=0.0)
    assert state["not_held"][f"{NAMESPACED_KIND}\x1fnamespace-share"] == 2
    assert state["not_held"][f"{KIND}\x1fstore-full"] == 0


def test_a_store_of_the_former_format_is_emptied_and_listed_again(tmp_path):
    import lmdb

    env = lmdb.open(str(tmp_path), map_size=1 << 20, subdir=True)
    with env.begin(write=True) as txn:  # keys without a generation, as the keeper wrote them before issue 47
        txn.put(b"ClusterTrainingRuntime\x1f\x1fold", Runtime.of(runtime("old")).to_bytes())
        txn.put(b"\0synced\x1fClusterTrainingRuntime", b"1")
    env.close()
    writer = StoreWriter(str(tmp_path))
    reader = StoreReader(str(tmp_path), env=writer.env)
    assert len(reader) == 0 and not reader.synced(KIND)
    writer.replace(KIND, [runtime("new")])
    assert names_of(reader) == {"new"} and reader.synced(KIND)
