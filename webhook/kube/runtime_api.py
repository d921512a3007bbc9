"""The keeper's reads of runtimes from the Kubernetes API: a list in pages, a watch, a get of one.

What the keeper's reads hold at once is bounded by bytes whatever the runtimes: a list page is parsed item by
item as it streams in (one runtime object at a time, at most the API server's object size), never whole.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ..core.runtimes import CLUSTER_KIND, GROUP, PLURALS, VERSION, Runtime, RuntimeUnavailable
from .reflector import Gone, ReadStats, slim

log = logging.getLogger(__name__)

WATCH_SECONDS = 240
LIST_PAGE = 500  # the most items a list page asks for; a page is parsed item by item as it streams in
FIRST_PAGE = 50  # items the first page asks for, before the runtimes' size is known
PAGE_BYTES = 4 * 1024 * 1024  # what a page should weigh: the API server must send it, and the keeper read and
# store it, inside the API server's 60 s request timeout even on a starved node (500 runtimes at the byte cap are
# 31 MB: on a loaded 2-core node such a page timed out, 2026-12-07)
STREAM_CHUNK = 64 * 1024  # bytes read from a list answer at a time
WINDOW = 16  # items in a row whose bytes judge the next page's size: enough that a read's chunk is not one item
RETRY_PAUSE = 1.0  # seconds before a failed page is asked for again, smaller: the API server may be the one overloaded
EDGE_BYTES = 64 * 1024  # the head and tail of a list answer kept to read its metadata (continue, resourceVersion)
LIVE_READ_TIMEOUT = (2.0, 3.0)  # connect, read: well inside the API server's webhook timeout


class Listing:
    """Every runtime of `kind`, page by page (one snapshot: the pages share its resourceVersion), each item
    parsed as it streams in and cut to its essentials at once; `version` is the list's resourceVersion once
    the pages are read. What is held at once is one item (at most the API server's object size) and the
    parser's buffer, whatever the page holds.

    A page that fails (the API server's request timeout cuts a page too heavy for a loaded node; the connection
    drops; a 5xx or 429) is asked for again, after RETRY_PAUSE, with a quarter of its runtimes or fewer (as many as
    PAGE_BYTES holds by what the failed page delivered): from the same continue token, which pins the same snapshot
    and order, skipping the runtimes already yielded. A first page, which has no token to pin it, makes the next
    list of this kind start smaller and fails this one (the reflector lists again after its backoff); a first page
    read whole sizes the next as it sizes any next page, up to FIRST_PAGE. A page grows at most twice the
    runtimes of the page before it, is sized by the page's heaviest run of runtimes, not its average, and does not
    grow while what a failed page yielded is read again.
    Without this, runtimes small first and at the byte cap after (a tenant orders them by name) made a 500-item
    page of 31 MB that failed each time: the keeper never listed again. A list heavier than the API server can send
    before its continue token expires (compaction, about 5 minutes) still cannot complete."""

    version: str | None

    def __init__(self, api: RuntimeAPI, kind: str):
        self.api, self.kind, self.version = api, kind, None

    def __iter__(self) -> Iterator[Runtime]:
        token, version, limit = None, "", self.api.first_page.get(self.kind, FIRST_PAGE)
        ahead = 0  # runtimes past `token` already yielded: read before a page failed, not to be yielded again
        while True:
            page, seen = None, 0
            try:
                answer = self._ask(token, limit)
                page = Page(answer)
                try:
                    for item in page:
                        seen += 1
                        if seen > ahead:
                            yield slim(item, self.kind)
                finally:
                    answer.release_conn()
            except Exception as e:
                ahead, limit = max(ahead, seen), self._smaller(e, token, limit, page)
                self.api.sleep(RETRY_PAUSE)
                continue
            if token is None and self.kind in self.api.first_page:
                self._first_page_read(page)
            ahead = max(0, ahead - seen)
            # While reading again what a failed page yielded, no larger: what failed lies just past it.
            limit = min(page.next_limit(), limit) if ahead else page.next_limit()
            meta = page.metadata()
            version = meta.get("resourceVersion") or version
            token = meta.get("continue")
            if not token:
                self.version = version
                return

    def _ask(self, token: str | None, limit: int):
        self.api.stats.request("list", self.kind)
        kw: dict[str, Any] = {"_continue": token} if token else {}
        return self.api.api.list_cluster_custom_object(GROUP, VERSION, PLURALS[self.kind], limit=limit,
                                                       _request_timeout=(5, 60), _preload_content=False, **kw)

    def _smaller(self, error: Exception, token: str | None, limit: int, page: Page | None) -> int:
        """The limit to ask for the page at `token` again with; raises when a smaller page cannot help: a page of
        one already, or a 4xx but 429 (410: the continue token expired, the list starts again)."""
        status = getattr(error, "status", None)
        if limit == 1 or (isinstance(status, int) and 400 <= status < 500 and status != 429):
            raise error
        smaller = max(1, limit // 4)
        if page is not None and page.items:
            smaller = min(smaller, page.next_limit())
        if token is None:
            self.api.first_page[self.kind] = smaller
            log.warning("%s first list page of %d failed (%s): the next list asks for %d", self.kind, limit,
                        str(error)[:200], smaller)
            raise error
        self.api.stats.error("list", self.kind)
        log.warning("%s list page of %d failed (%s): asking for %d", self.kind, limit, str(error)[:200], smaller)
        return smaller

    def _first_page_read(self, page: Page) -> None:
        """A first page read whole after one failed: the next list's first page sized by it, up to FIRST_PAGE."""
        grown = page.next_limit()
        if grown >= FIRST_PAGE:
            del self.api.first_page[self.kind]
        else:
            self.api.first_page[self.kind] = grown


def next_limit(page_bytes: int, items: int) -> int:
    """Items the next page asks for so that it weighs about PAGE_BYTES, judged by the page just read."""
    if not items:
        return LIST_PAGE
    return max(1, min(LIST_PAGE, PAGE_BYTES * items // max(page_bytes, 1)))


class Page:
    """One list answer read as a stream: its items one at a time (ijson, yajl's C parser), then its metadata,
    found in the first or the last EDGE_BYTES of the answer (the API server puts `metadata` before `items`
    when it streams a list, after them when it sorts an unstructured list's keys)."""

    def __init__(self, stream):
        self.stream = stream
        self.head = bytearray()
        self.tail = b""
        self.size = 0  # bytes read
        self.items = 0  # items parsed
        self.heaviest = 0.0  # the most bytes an item took, on average over WINDOW items in a row

    def read(self, size: int = -1) -> bytes:
        if size == 0:  # ijson asks for nothing first, to learn whether the stream gives bytes or text
            return b""
        data = self.stream.read(size if size > 0 else STREAM_CHUNK)
        self.size += len(data)
        if len(self.head) < EDGE_BYTES:
            self.head += data[:EDGE_BYTES - len(self.head)]
        self.tail = (self.tail + data)[-EDGE_BYTES:]
        return data

    def __iter__(self) -> Iterator[dict]:
        """The items, noting the heaviest run of WINDOW of them: a page of small runtimes then large ones is judged
        by the large ones, not by its average (which asked for a next page of large ones twice too heavy)."""
        import ijson

        marks: deque[int] = deque(maxlen=WINDOW + 1)  # bytes read when each of the last items was parsed
        for item in ijson.items(self, "items.item", buf_size=STREAM_CHUNK):
            self.items += 1
            marks.append(self.size)
            if len(marks) > WINDOW:
                self.heaviest = max(self.heaviest, (marks[-1] - marks[0]) / WINDOW)
            yield item

    def next_limit(self) -> int:
        """Items the next page asks for: about PAGE_BYTES by this page's heaviest run, and at most twice its items
        (what follows may be heavier than anything read yet)."""
        by_average = next_limit(self.size, self.items)
        by_heaviest = int(PAGE_BYTES // self.heaviest) if self.heaviest else LIST_PAGE
        return max(1, min(by_average, by_heaviest, 2 * max(self.items, 1)))

    def metadata(self) -> dict:
        import ijson
        import orjson

        try:  # metadata first: the head holds it whole, before the items
            for meta in ijson.items(bytes(self.head), "metadata"):
                return meta if isinstance(meta, dict) else {}
        except ijson.IncompleteJSONError:
            pass
        at = self.tail.rfind(b'"metadata":')  # metadata last: the answer ends with it and the list's `}`
        if at < 0:
            return {}
        try:
            meta = orjson.loads(self.tail[at + len(b'"metadata":'):].rstrip()[:-1])
        except orjson.JSONDecodeError:
            return {}
        return meta if isinstance(meta, dict) else {}


class RuntimeAPI:
    """The three reads of runtimes the keeper makes: list (in pages), watch, and get one."""

    def __init__(self, api_client, stats: ReadStats | None = None):
        from kubernetes import client

        self.api: Any = client.CustomObjectsApi(api_client)  # Any: the client types JSON answers as object
        self.stats = stats or ReadStats()
        self.first_page: dict[str, int] = {}  # per kind, when a first page failed: what the next list asks for
        self.sleep: Callable[[float], None] = time.sleep

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        self.stats.request("get", kind)
        try:
            return read_runtime(self.api, kind, namespace, name, LIVE_READ_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            self.stats.error("get", kind)
            raise RuntimeUnavailable(f"the API server answered {e.status} {e.reason}") from None
        except Exception as e:
            self.stats.error("get", kind)
            raise RuntimeUnavailable(f"the API server cannot be reached: {type(e).__name__}") from None

    def list(self, kind: str) -> Listing:
        return Listing(self, kind)

    def watch(self, kind: str, version: str) -> Iterator[dict]:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        self.stats.request("watch", kind)
        w = watch.Watch()
        try:
            for event in w.stream(self.api.list_cluster_custom_object, GROUP, VERSION, PLURALS[kind],
                                  resource_version=version, timeout_seconds=WATCH_SECONDS,
                                  allow_watch_bookmarks=True, _request_timeout=(5, WATCH_SECONDS + 30)):
                yield {"type": event.get("type"), "object": event.get("raw_object") or event.get("object")}
        except ApiException as e:
            if e.status == 410:
                raise Gone() from None
            raise
        finally:
            w.stop()


def read_runtime(api, kind: str, namespace: str, name: str, timeout) -> dict:
    """One runtime by kind and name (a CustomObjectsApi GET); raises the client's ApiException (404: none)."""
    if kind == CLUSTER_KIND:
        return api.get_cluster_custom_object(GROUP, VERSION, PLURALS[kind], name, _request_timeout=timeout)
    return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURALS[kind], name, _request_timeout=timeout)
