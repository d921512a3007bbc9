"""What an Admission keeps of what the rules decided of runtimes (issue 49): owned by the Admission, keyed by the
runtime's key and resourceVersion for the settings in use, bounded in entries and in bytes."""

import dataclasses

from tests.helpers import admission, runtime
from webhook.core.memos import Memos
from webhook.core.runtimes import Runtime


def taken(name: str, version: str = "1", **kw) -> Runtime:
    obj = runtime(name, **kw)
    obj["metadata"]["resourceVersion"] = version
    return Runtime.of(obj)


def test_at_most_entries_are_kept_the_oldest_written_dropped_first():
    memos: Memos[str] = Memos(lambda v: 0, entries=3)
    rts = [taken(f"r{i}") for i in range(4)]
    for r in rts[:3]:
        memos.put(r, "token", r.name)
    assert len(memos) == 3 and all(memos.get(r, "token") == r.name for r in rts[:3])
    memos.put(rts[3], "token", "r3")
    assert len(memos) == 3 and memos.get(rts[0], "token") is None
    assert [memos.get(r, "token") for r in rts[1:]] == ["r1", "r2", "r3"]


def test_at_most_size_bytes_are_kept():
    rts = [taken(f"r{i}") for i in range(3)]
    each = len(rts[0].to_bytes()) + 100
    memos: Memos[str] = Memos(lambda v: 100, size=2 * each)
    memos.put(rts[0], "t", "a")
    memos.put(rts[1], "t", "b")
    assert memos.bytes == 2 * each and len(memos) == 2  # at the bound: both kept
    memos.put(rts[2], "t", "c")
    assert memos.bytes == 2 * each and memos.get(rts[0], "t") is None and memos.get(rts[2], "t") == "c"


def test_a_value_larger_than_the_whole_memo_is_not_kept():
    memos: Memos[str] = Memos(lambda v: len(v), size=1000)
    memos.put(taken("big"), "t", "x" * 1000)
    assert len(memos) == 0 and memos.bytes == 0


def test_a_memo_is_for_its_token_and_its_runtime_as_it_is():
    memos: Memos[str] = Memos(lambda v: 0)
    r = taken("r")
    memos.put(r, "settings-1", "decided")
    assert memos.get(r, "settings-2") is None  # other settings: decided again
    assert memos.get(taken("r"), "settings-1") == "decided"  # the same runtime read again (another object)
    assert memos.get(taken("r", version="2"), "settings-1") is None  # a new resourceVersion
    changed = taken("r", jobs={"node": {"containers": [{"name": "other"}]}})  # same key and version, other content
    assert memos.get(changed, "settings-1") is None


def test_the_admission_decides_a_runtime_once_per_settings():
    adm = admission()
    r = taken("torch-distributed")
    first = adm._decided(adm._live, r)
    assert adm._decided(adm._live, r) is first and len(adm.memos) == 1
    assert adm.switch(dataclasses.replace(adm.settings, manager="other.example.com"))
    assert adm._decided(adm._live, r) is not first and len(adm.memos) == 1  # replaced, not beside it
