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


class TooMany(BaseException):
    """Not an Exception: the listing under test cannot take it for a failed page and go on asking."""


class Answer(io.BytesIO):
    def release_conn(self) -> None:
        self.close()


class Objects:
    """The list call of CustomObjectsApi over `count` runtimes, each padded to `pad` bytes, answering `limit`."""

    def __init__(self, count: int, pad: int, large_from: int = 0, cut_over: int = 0, status: int = 0,
                 continued_status: int = 0):
        """Runtimes from `large_from` on are padded (all of them by default); a page heavier than `cut_over` bytes
        is cut halfway, as the API server's request timeout cuts a page it cannot send in time (or, with `status`,
        answered with that status); with `continued_status`, every page after the first is answered with it."""
        self.count, self.pad, self.limits, self.cuts, self.cut_at = count, pad, [], 0, []
        self.yielded_at_cut = 0  # the runtimes of the first cut page a parser could read before the cut
        self.large_from, self.cut_over, self.status = large_from, cut_over, status
        self.continued_status = continued_status

    def list_cluster_custom_object(self, group, version, plural, *, limit, _continue=None, **_):
        self.limits.append(limit)
        if len(self.limits) > 1000:
            raise TooMany(f"asked {len(self.limits)} times: {self.limits[-5:]}")
        if _continue and self.continued_status:
            raise ApiException(status=self.continued_status, reason="Refused")
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
            self.cuts += 1
            self.cut_at.append(len(self.limits) - 1)
            if self.status:
                raise ApiException(status=self.status, reason="Gone")
            half = body[:len(body) // 2]
            if self.cuts == 1:
                self.yielded_at_cut = half.count(b'"kind": "TrainingRuntime"') - 1
            return Answer(half)
        return Answer(body)


class API:
    def __init__(self, objects: Objects):
        self.api, self.stats, self.first_page, self.pauses = objects, runtime_api.ReadStats(), {}, []
        self.sleep = self.pauses.append


def test_pages_of_runtimes_at_the_cap_weigh_about_page_bytes():
    objects = Objects(400, 60_000)
    listing = Listing(API(objects), "TrainingRuntime")  # type: ignore[arg-type]
    assert [r.name for r in listing] == [f"rt-{i}" for i in range(400)] and listing.version == "7"
    assert objects.limits[0] == FIRST_PAGE
    # ~62 KB each: 4 MiB is some 67 of them, not LIST_PAGE's 500 (31 MB: a page a starved node could not send in time)
    assert all(55 <= n <= 70 for n in objects.limits[1:]), objects.limits


def test_pages_of_small_runtimes_grow_to_the_most_twice_the_page_before_at_a_time():
    objects = Objects(1600, 0)
    assert len(list(Listing(API(objects), "TrainingRuntime"))) == 1600  # type: ignore[arg-type]
    assert objects.limits[:6] == [FIRST_PAGE, 100, 200, 400, LIST_PAGE, LIST_PAGE], objects.limits


def test_next_limit_bounds():
    assert next_limit(0, 0) == LIST_PAGE
    assert next_limit(PAGE_BYTES * 100, 1) == 1  # one runtime larger than a page: one at a time
    assert next_limit(1000, 10) == LIST_PAGE


def test_a_page_cut_for_its_weight_is_asked_for_again_smaller_each_runtime_once():
    # 600 small runtimes, then 400 at ~62 KB: judged by the small ones the page at the boundary asks for 400, some
    # 9 MB; every page over 8 MB is cut. Without reading it again smaller the list fails each time.
    objects = Objects(1000, 60_000, large_from=600, cut_over=8_000_000)
    api = API(objects)
    listing = Listing(api, "TrainingRuntime")  # type: ignore[arg-type]
    assert [r.name for r in listing] == [f"rt-{i}" for i in range(1000)] and listing.version == "7"
    assert objects.cuts == 1, objects.limits  # asked for again by what the cut page delivered, not cut again
    at = objects.cut_at[0]
    assert objects.limits[at + 1] <= objects.limits[at] // 4, objects.limits
    assert api.stats.errors.get("list\x1fTrainingRuntime", 0) == 1 and api.pauses == [runtime_api.RETRY_PAUSE]


def test_a_smaller_page_read_again_skips_what_the_cut_page_yielded_across_pages():
    # The page at the boundary is cut partway through the large runtimes; the page asked for again holds fewer
    # runtimes than were already yielded: what was yielded is skipped on the pages after it too.
    objects = Objects(700, 60_000, large_from=560, cut_over=6_000_000)
    names = [r.name for r in Listing(API(objects), "TrainingRuntime")]  # type: ignore[arg-type]
    assert names == [f"rt-{i}" for i in range(700)], len(names)
    at = objects.cut_at[0]
    assert objects.limits[at + 1] < objects.yielded_at_cut, (objects.limits, objects.yielded_at_cut)


def test_runtimes_at_the_api_servers_object_size_after_small_ones_are_met_with_small_pages():
    # 60 small runtimes, then 20 of 1.4 MB (the namespace share counts stored bytes, not the objects' size): the
    # page asked for again is sized by what the cut page delivered, and a page grows at most twice the one before,
    # so one cut, not one a page (each a minute of the API server's timeout: the continue token expires first).
    objects = Objects(80, 1_400_000, large_from=60, cut_over=8_000_000)
    names = [r.name for r in Listing(API(objects), "TrainingRuntime")]  # type: ignore[arg-type]
    assert names == [f"rt-{i}" for i in range(80)]
    assert objects.cuts == 1, objects.limits


def test_a_first_page_that_fails_makes_the_next_list_start_smaller_then_as_large_as_its_runtimes_allow():
    # 50 runtimes of 200 KB are a 10 MB first page, cut: the next list starts with 12; read whole, it sizes the one
    # after by its runtimes (4 MiB of them: 20), and a list of small runtimes starts with FIRST_PAGE again.
    objects = Objects(200, 200_000, cut_over=8_000_000)
    api = API(objects)
    with pytest.raises(ijson.IncompleteJSONError):
        list(Listing(api, "TrainingRuntime"))  # type: ignore[arg-type]
    assert objects.limits == [FIRST_PAGE]  # no token pins a first page's snapshot: not read again in this list
    assert [r.name for r in Listing(api, "TrainingRuntime")] == [f"rt-{i}" for i in range(200)]  # type: ignore
    assert objects.limits[1] == FIRST_PAGE // 4 and objects.cuts == 1
    assert 15 <= api.first_page["TrainingRuntime"] <= 24, api.first_page
    for _ in range(2):
        assert len(list(Listing(api, "TrainingRuntime"))) == 200  # type: ignore[arg-type]
    assert objects.cuts == 1, objects.limits
    objects.pad = 0
    for _ in range(2):  # twice the page read at most each time
        list(Listing(api, "TrainingRuntime"))  # type: ignore[arg-type]
    assert api.first_page == {}, "small runtimes: back to FIRST_PAGE"


def test_an_expired_continue_token_is_not_asked_for_again():
    objects = Objects(600, 60_000, large_from=100, cut_over=3_000_000, status=410)
    with pytest.raises(ApiException):
        list(Listing(API(objects), "TrainingRuntime"))  # type: ignore[arg-type]
    assert objects.cuts == 1 and len(objects.limits) == objects.cut_at[0] + 1, objects.limits


def test_a_continued_page_that_always_fails_is_asked_for_down_to_one_runtime_then_the_list_fails():
    objects = Objects(300, 0, continued_status=500)
    api = API(objects)
    with pytest.raises(ApiException):
        list(Listing(api, "TrainingRuntime"))  # type: ignore[arg-type]
    assert objects.limits == [FIRST_PAGE, 100, 25, 6, 1], objects.limits
    assert api.pauses == [runtime_api.RETRY_PAUSE] * 3


def test_a_continued_page_refused_is_not_asked_for_again():
    objects = Objects(300, 0, continued_status=403)
    with pytest.raises(ApiException):
        list(Listing(API(objects), "TrainingRuntime"))  # type: ignore[arg-type]
    assert objects.limits == [FIRST_PAGE, 100], objects.limits


def test_a_page_small_then_large_is_judged_by_its_large_runtimes_not_its_average():
    # The third page holds 150 small runtimes and 50 at ~62 KB: by its average the next would ask for 262 (16 MB,
    # cut); by its heaviest run of runtimes, for about 4 MiB of them.
    objects = Objects(600, 60_000, large_from=300, cut_over=8_000_000)
    assert len(list(Listing(API(objects), "TrainingRuntime"))) == 600  # type: ignore[arg-type]
    assert objects.limits[:3] == [FIRST_PAGE, 100, 200] and objects.cuts == 0, objects.limits
    assert 55 <= objects.limits[3] <= 70, objects.limits
