"""The keeper's reads of runtimes from the Kubernetes API: a list in pages, a watch, a get of one.

What the keeper's reads hold at once is bounded by bytes whatever the runtimes: a list page is parsed item by
item as it streams in (one runtime object at a time, at most the API server's object size), never whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..core.runtimes import CLUSTER_KIND, GROUP, PLURALS, VERSION, Runtime, RuntimeUnavailable
from .reflector import Gone, ReadStats, slim

WATCH_SECONDS = 240
LIST_PAGE = 500  # the most items a list page asks for; a page is parsed item by item as it streams in
FIRST_PAGE = 50  # items the first page asks for, before the runtimes' size is known
PAGE_BYTES = 4 * 1024 * 1024  # what a page should weigh: the API server must send it, and the keeper read and
# store it, inside the API server's 60 s request timeout even on a starved node (500 runtimes at the byte cap are
# 31 MB: on a loaded 2-core node such a page timed out, 2026-12-07)
STREAM_CHUNK = 64 * 1024  # bytes read from a list answer at a time
EDGE_BYTES = 64 * 1024  # the head and tail of a list answer kept to read its metadata (continue, resourceVersion)
LIVE_READ_TIMEOUT = (2.0, 3.0)  # connect, read: well inside the API server's webhook timeout


class Listing:
    """Every runtime of `kind`, page by page (one snapshot: the pages share its resourceVersion), each item
    parsed as it streams in and cut to its essentials at once; `version` is the list's resourceVersion once
    the pages are read. What is held at once is one item (at most the API server's object size) and the
    parser's buffer, whatever the page holds."""

    version: str | None

    def __init__(self, api: RuntimeAPI, kind: str):
        self.api, self.kind, self.version = api, kind, None

    def __iter__(self) -> Iterator[Runtime]:
        token, version, limit = None, "", FIRST_PAGE
        while True:
            self.api.stats.request("list", self.kind)
            kw: dict[str, Any] = {"_continue": token} if token else {}
            answer = self.api.api.list_cluster_custom_object(GROUP, VERSION, PLURALS[self.kind], limit=limit,
                                                             _request_timeout=(5, 60), _preload_content=False, **kw)
            page, items = Page(answer), 0
            try:
                for item in page:
                    items += 1
                    yield slim(item, self.kind)
            finally:
                answer.release_conn()
            limit = next_limit(page.size, items)
            meta = page.metadata()
            version = meta.get("resourceVersion") or version
            token = meta.get("continue")
            if not token:
                self.version = version
                return


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
        import ijson

        return ijson.items(self, "items.item", buf_size=STREAM_CHUNK)

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
