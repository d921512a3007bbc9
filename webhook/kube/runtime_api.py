"""The keeper's reads of runtimes from the Kubernetes API: a list in pages, a watch, a get of one.

What the keeper's reads hold at once is bounded by bytes whatever the runtimes: a list page is parsed item by
item as it streams in (one runtime object at a time, at most the API server's object size), never whole.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
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
EDGE_BYTES = 64 * 1024  # the head and tail of a list answer kept to read its metadata (continue, resourceVersion)
LIVE_READ_TIMEOUT = (2.0, 3.0)  # connect, read: well inside the API server's webhook timeout


class Listing:
    """Every runtime of `kind`, page by page (one snapshot: the pages share its resourceVersion), each item
    parsed as it streams in and cut to its essentials at once; `version` is the list's resourceVersion once
    the pages are read. What is held at once is one item (at most the API server's object size) and the
    parser's buffer, whatever the page holds.

    A page that fails (the API server's request timeout cuts a page too heavy for a loaded node; the connection
    drops) is asked for again with a quarter of its runtimes: from the same continue token, which pins the same
    snapshot and order, skipping the runtimes already yielded; a first page, which has no token to pin it, makes
    the next list of this kind start smaller and the list fail (the reflector lists again after its backoff).
    Without it, runtimes small first and at the byte cap after (a tenant orders them by name) made a 500-item
    page of 31 MB that failed each time: the keeper never listed again."""

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
                self._failed(e, token, limit)
                ahead, limit = max(ahead, seen), max(1, limit // 4)
                continue
            ahead = max(0, ahead - seen)
            limit = next_limit(page.size, seen)
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

    def _failed(self, error: Exception, token: str | None, limit: int) -> None:
        """Return to read the page at `token` again, smaller; raise when that cannot help."""
        if getattr(error, "status", None) == 410 or limit == 1:  # an expired continue token: list again
            raise error
        if token is None:
            self.api.first_page[self.kind] = max(1, limit // 4)
            raise error
        self.api.stats.error("list", self.kind)
        log.warning("%s list page of %d failed (%s): asking for %d", self.kind, limit, str(error)[:200],
                    max(1, limit // 4))


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
        self.first_page: dict[str, int] = {}  # per kind, when a first page failed: what the next list asks for

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
