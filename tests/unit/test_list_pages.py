"""The keeper's list pages are bounded in bytes (issue 47): the first page asks for few runtimes, each next one for
as many as make about PAGE_BYTES by the size of the runtimes just read, never more than LIST_PAGE."""

from __future__ import annotations

import io
import json

from tests.helpers import runtime
from webhook.kube import runtime_api
from webhook.kube.runtime_api import FIRST_PAGE, LIST_PAGE, PAGE_BYTES, Listing, next_limit


class Answer(io.BytesIO):
    def release_conn(self) -> None:
        self.close()


class Objects:
    """The list call of CustomObjectsApi over `count` runtimes, each padded to `pad` bytes, answering `limit`."""

    def __init__(self, count: int, pad: int):
        self.count, self.pad, self.limits = count, pad, []

    def list_cluster_custom_object(self, group, version, plural, *, limit, _continue=None, **_):
        self.limits.append(limit)
        start = int(_continue or 0)
        end = min(self.count, start + limit)
        items = []
        for i in range(start, end):
            obj = runtime(f"rt-{i}", kind="TrainingRuntime", namespace="team-a")
            obj["metadata"]["annotations"] = {"pad": "x" * self.pad}
            items.append(obj)
        meta = {"resourceVersion": "7", **({"continue": str(end)} if end < self.count else {})}
        return Answer(json.dumps({"metadata": meta, "items": items}).encode())


class API:
    def __init__(self, objects: Objects):
        self.api, self.stats = objects, runtime_api.ReadStats()


def test_pages_of_runtimes_at_the_cap_weigh_about_page_bytes():
    objects = Objects(400, 60_000)
    listing = Listing(API(objects), "TrainingRuntime")  # type: ignore[arg-type]
    assert [r.name for r in listing] == [f"rt-{i}" for i in range(400)] and listing.version == "7"
    assert objects.limits[0] == FIRST_PAGE
    # ~62 KB each: 4 MiB is some 67 of them, not LIST_PAGE's 500 (31 MB: a page a starved node could not send in time)
    assert all(55 <= n <= 70 for n in objects.limits[1:]), objects.limits


def test_pages_of_small_runtimes_ask_for_the_most():
    objects = Objects(1200, 0)
    assert len(list(Listing(API(objects), "TrainingRuntime"))) == 1200  # type: ignore[arg-type]
    assert objects.limits[:3] == [FIRST_PAGE, LIST_PAGE, LIST_PAGE], objects.limits


def test_next_limit_bounds():
    assert next_limit(0, 0) == LIST_PAGE
    assert next_limit(PAGE_BYTES * 100, 1) == 1  # one runtime larger than a page: one at a time
    assert next_limit(1000, 10) == LIST_PAGE
