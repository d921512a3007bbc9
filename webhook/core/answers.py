"""Answers kept for the TrainJob CREATE reviews that repeat (issue 49): the API server sends a TrainJob made from
one manifest again and again, differing in its name alone, and the rules decide it the same way each time.

What a CREATE is decided from is its verb, its namespace, its spec, the settings in use, the runtime it names and
the admission time (a review's name never changes a decision that admits it: only a refusal's text names it). So
an answer that admits is kept under the verb, the namespace and the spec as JSON text (orjson, keys sorted: equal
texts are equal JSON values, `true` never `1`), with the settings, the runtime and the time it was decided with;
a review finds it only while all three are the same (the runtime read again, as every review reads it). A refusal,
an UPDATE, a spec and namespace over KEY_LIMIT bytes, one orjson cannot write or writes with a `null` (NaN and
infinities among them), a decision in warn or audit mode, and one made with the previous settings or while their
grace lasts are never kept: they are decided in full each time, as is a kept key whose runtime cannot be read.

Why: a review that reaches a worker idle for milliseconds (every review at concurrency 1) costs 10 times what it
costs back to back, in proportion to the code and memory it touches (docs/performance.md, "A review after
idling"); a kept answer touches a few dicts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson

from .decision import Outcome, Verb
from .request import names
from .review import API_VERSION
from .reviewing import Result
from .runtimes import GROUP, PLURALS, TRAINJOB_KIND, Runtime, RuntimeRef, RuntimeSource

TRAINJOBS = PLURALS[TRAINJOB_KIND]
ENTRIES = 256      # answers kept, the oldest kept dropped first
KEY_LIMIT = 4096   # bytes of spec (as JSON text) and namespace: a longer key is decided in full each time


class Kept(NamedTuple):
    """One admitting answer, and what it was decided with."""

    live: object                        # the settings in use (Admission's `_Live`: replaced whole on a switch)
    stamp: str                          # the admission time its patch carries, "" when it has no patch
    ref: RuntimeRef                     # the runtime it read
    runtime: Runtime
    response: dict[str, Any]            # the AdmissionResponse but its uid
    ops: tuple[Any, ...]                # for the Outcome
    warnings: tuple[str, ...]


Key = tuple[Verb, str, bytes]  # (verb, namespace, spec as JSON text, keys sorted)


class Answers:
    """The kept answers: read without a lock (one dict read), written under one; at most `entries`."""

    def __init__(self, entries: int = ENTRIES):
        self.entries = entries
        self._items: dict[Key, Kept] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def find(self, doc: Any, verb: Verb, live: object, runtimes: RuntimeSource,
             stamp: Callable[[], str]) -> tuple[Result | None, Key | None]:
        """(the answer kept for the review `doc`, the key it is kept under): the answer while the settings in use
        (`live`), the runtime and the admission time (`stamp()`) are those it was decided with, else None; the
        key for a TrainJob CREATE the API server's way (its `resource` named), else None. One function, read in
        line: a review reaching an idle worker pays for each function and module it touches."""
        req: Any = doc.get("request") if doc.__class__ is dict and verb is not Verb.RUNTIMES else None
        if (req.__class__ is not dict or req.get("operation") != "CREATE" or req.get("subResource")
                or doc.get("apiVersion") != API_VERSION or doc.get("kind") != "AdmissionReview"):
            return None, None  # parse_review and request.target decide
        res, uid, obj = req.get("resource"), req.get("uid"), req.get("object")
        if (res.__class__ is not dict or res.get("group") != GROUP or res.get("resource") != TRAINJOBS
                or uid.__class__ is not str or not uid or obj.__class__ is not dict):
            return None, None
        spec, meta = obj.get("spec"), obj.get("metadata")
        if spec.__class__ is not dict or meta.__class__ is not dict:
            return None, None
        name, namespace = meta.get("name"), meta.get("namespace")
        if name.__class__ is not str or not name or namespace.__class__ is not str or not namespace:
            name, namespace = names(req, obj)  # the metadata's, else the request's
            name = name or str(req.get("name") or "")  # as a review decided in full names it
        try:
            text = orjson.dumps(spec, option=orjson.OPT_SORT_KEYS)
        except (TypeError, orjson.JSONEncodeError):  # past 64-bit integers, lone surrogates, nested past 255
            return None, None
        # The namespace counts too (the API server sends at most 63 bytes; a direct caller, any size). A `null`
        # may be NaN or an infinity the body's parser read (orjson writes them as null): such a spec is decided
        # in full, never under the key of one holding null.
        if len(text) + len(namespace) > KEY_LIMIT or b"null" in text:
            return None, None
        key = (verb, namespace, text)
        kept = self._items.get(key)
        if kept is None or kept.live is not live:
            return None, key
        return self._answer(kept, uid, verb, name, namespace, runtimes, stamp), key

    def _answer(self, kept: Kept, uid: str, verb: Verb, name: str, namespace: str,
                runtimes: RuntimeSource, stamp: Callable[[], str]) -> Result | None:
        ref = kept.ref
        try:
            runtime = runtimes.get(ref.kind, ref.namespace, ref.name)
        except Exception:  # RuntimeUnavailable, or a fault of the source: decided in full, which says so
            return None
        if runtime is not kept.runtime and runtime != kept.runtime:  # changed, gone or PENDING
            return None
        if kept.stamp and kept.stamp != stamp():
            return None
        response: Any = {"uid": uid, **kept.response}
        if "warnings" in response:
            response["warnings"] = list(response["warnings"])
        outcome = Outcome(uid=uid, verb=verb, operation="CREATE", namespace=namespace, name=name, intercepted=True,
                          ops=kept.ops, warnings=kept.warnings)
        return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}, outcome

    def keep(self, key: Key, live: object, stamp: str, read: tuple[RuntimeRef, Runtime], result: Result) -> None:
        """Keep `result` when it admits: decided with the settings `live`, the runtime `read` and the admission
        time `stamp`."""
        response, outcome = result
        if outcome.reasons or outcome.would_deny:
            return
        kept: dict[str, Any] = {k: v for k, v in response["response"].items() if k != "uid"}
        if "warnings" in kept:
            kept["warnings"] = tuple(kept["warnings"])  # the caller's list is its own
        self.put(key, Kept(live, stamp if outcome.ops else "", read[0], read[1], kept, outcome.ops, outcome.warnings))

    def put(self, key: Key, kept: Kept) -> None:
        with self._lock:
            self._items.pop(key, None)
            while len(self._items) >= self.entries:
                self._items.pop(next(iter(self._items)))
            self._items[key] = kept

    def clear(self) -> None:
        with self._lock:
            self._items = {}
