"""The keeper's list pages are bounded in bytes (issue 47): the first page asks for few runtimes, each next one for
as many as make about PAGE_BYTES by the size of the runtimes just read, never more than LIST_PAGE; a page that fails
is asked for again smaller, from the same continue token, each runtime yielded once."""

from __future__ import annotations

import io
import json

import ijson
import pytest
from kubernetes.client.exceptions import ApiException

from tests.helpers import runtime
from webhook.kube import runtime_api
from webhook.kube.runtime_api import FIRST_PAGE, LIST_PAGE, PAGE_BYTES, Listing, next_limit


class Answer(io.BytesIO):
    def release_conn(self) -> None:
        self.close()


class Objects:
    """The list call of CustomObjectsApi over `count` runtimes, each padded to `pad` bytes, answering `limit`."""

    def __init__(self, count: int, pad: int, large_from: int = 0, cut_over: int = 0, status: int = 0):
        """Runtimes from `large_from` on are padded (all of them by default); a page heavier than `cut_over` bytes
        is cut halfway, as the API server's request timeout cuts a page it cannot send in time (or, with `status`,
        answered with that status)."""
        self.count, self.pad, self.limits = count, pad, []
        self.large_from, self.cut_over, self.status = large_from, cut_over, status

    def list_cluster_custom_object(self, group, version, plural, *, limit, _continue=None, **_):
        self.limits.append(limit)
        start = int(_continue or 0)
        end = min(self.count, start + limit)
        items = []
        for i in range(start, end):
            obj = runtime(f"rt-{i}", kind="TrainingRuntime", namespace="team-a")
            obj["metadata"]["annotations"] = {"pad": "x" * (self.pad if i >= self.large_from else 0)}
            items.append(obj)
        meta = {"resourceVersion": "7", **({"continue": str(end)} if end < self.count else {})}
        body = json.dumps({"metadata": meta, "items": items}).encode()
        if self.cut_over and len(body) > self.cut_over:
            if self.status:
                raise ApiException(status=self.status, reason="Gone")
            return Answer(body[:len(body) // 2])
        return Answer(body)


class API:
    def __init__(self, objects: Objects):
        self.api, self.stats, self.first_page = objects, runtime_api.ReadStats(), {}


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


def test_a_page_cut_for_its_weight_is_asked_for_again_smaller_each_runtime_once():
    # 600 small runtimes, then 400 at ~62 KB: judged by the small ones the page at the boundary asks for 500, some
    # 25 MB; every page over 8 MB is cut. Without reading it again smaller the list fails each time.
    objects = Objects(1000, 60_000, large_from=600, cut_over=8_000_000)
    api = API(objects)
    listing = Listing(api, "TrainingRuntime")  # type: ignore[arg-type]
    assert [r.name for r in listing] == [f"rt-{i}" for i in range(1000)] and listing.version == "7"
    cut = [n for n in objects.limits if n == LIST_PAGE]
    assert len(cut) >= 2 and LIST_PAGE // 4 in objects.limits, objects.limits  # 500 cut, then 125 asked for
    assert api.stats.errors.get("list\x1fTrainingRuntime", 0) >= 1


def test_a_smaller_page_read_again_skips_what_the_cut_page_yielded_across_pages():
    # The first 500-item page is cut halfway through the large runtimes; its smaller retries hold fewer runtimes
    # than were already yielded: what was yielded is skipped on the pages after too.
    objects = Objects(700, 60_000, large_from=560, cut_over=6_000_000)
    names = [r.name for r in Listing(API(objects), "TrainingRuntime")]  # type: ignore[arg-type]
    assert names == [f"rt-{i}" for i in range(700)], len(names)


def test_a_first_page_that_fails_makes_the_next_list_start_smaller():
    objects = Objects(200, 60_000, cut_over=2_000_000)
    api = API(objects)
    with pytest.raises(ijson.IncompleteJSONError):
        list(Listing(api, "TrainingRuntime"))  # type: ignore[arg-type]
    assert objects.limits == [FIRST_PAGE]  # no token pins a first page's snapshot: not read again in this list
    assert [r.name for r in Listing(api, "TrainingRuntime")] == [f"rt-{i}" for i in range(200)]  # type: ignore
    assert objects.limits[1] == FIRST_PAGE // 4


def test_an_expired_continue_token_is_not_asked_for_again():
    objects = Objects(600, 60_000, large_from=100, cut_over=8_000_000, status=410)
    with pytest.raises(ApiException):
        list(Listing(API(objects), "TrainingRuntime"))  # type: ignore[arg-type]
    assert objects.limits == [FIRST_PAGE, LIST_PAGE], objects.limits
