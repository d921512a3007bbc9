"""Settings that change while the webhook serves (SPEC 2.1): followed from the chart's ConfigMap through
the Kubernetes API (a watch of that one object), or from a file re-read when it changes.

Each source hands good settings to `on_change` and keeps the last good ones when an edit fails to parse, or
names a publish repository not fixed at deploy time (webhook.core.sources): it logs the ErrInvalid message
and sets `dispatch_admission_settings_valid` to 0 (1 again with the next good settings); the replica stays
ready. `refresh()` reads the settings once more, for the core to call before
an S4 refusal; it reads at most once a second, so forged entries cannot turn into load on the API server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core import sources
from ..core.errors import Denied
from ..core.settings import Settings, parse
from ..core.strict_json import doc_reason
from ..process import metrics
from ..process.blocking import WouldBlock, blocking_allowed
from .reflector import Backoff

log = logging.getLogger(__name__)

SETTINGS_KEY = "settings.json"
POLL_SECONDS = 0.5            # a file's change is seen within this
REFRESH_INTERVAL = 1.0        # at most one refresh read a second
WATCH_SECONDS = 300
READ_TIMEOUT = (2.0, 3.0)     # connect, read: well inside the API server's webhook timeout

OnChange = Callable[[Settings], None]


class LiveSettings:
    """What both sources share: parsing, the validity gauge, the change callback and the refresh limit."""

    where = "settings"

    def __init__(self, clock: Callable[[], float] = time.monotonic, repositories: frozenset[str] | None = None):
        self.clock = clock
        self.repositories = repositories  # where the publish image may come from; None: not checked
        self.on_change: OnChange = lambda s: None
        self._last_refresh = float("-inf")
        self._refresh_lock = threading.Lock()
        self.stopped = threading.Event()

    def read_text(self) -> bytes:
        raise NotImplementedError

    def read(self) -> Settings:
        """The settings as they are now; raises Denied (ErrInvalid) when they cannot be used."""
        return self.parse(self.read_text())

    def parse(self, text: bytes) -> Settings:
        """Settings that parse and name a publish repository fixed at deploy time; raises Denied."""
        settings = parse(text)
        return settings if self.repositories is None else sources.check(settings, self.repositories)

    def take(self, text: bytes) -> Settings | None:
        """Parse `text`; good settings go to on_change, bad ones are logged and keep the last good ones."""
        try:
            settings = self.parse(text)
        except Denied as e:
            metrics.set_settings_valid(False)
            log.error(json.dumps({"msg": "settings refused: the last good settings stay in use",
                                  "source": self.where, "error": str(e)[:2000]}))
            return None
        metrics.set_settings_valid(True)
        self.on_change(settings)
        return settings

    def refresh(self) -> Settings | None:
        """Read the settings once more (at most once a second): the good ones read, else None."""
        if not blocking_allowed():
            raise WouldBlock("reading the settings again")  # the core asks for it where blocking is allowed
        with self._refresh_lock:
            now = self.clock()
            if now - self._last_refresh < REFRESH_INTERVAL:
                return None
            self._last_refresh = now
        try:
            text = self.read_text()
        except Denied:
            return None
        except Exception as e:  # the API or the file cannot be read now: the refusal stands
            log.warning(json.dumps({"msg": "settings refresh failed", "source": self.where, "error": str(e)[:300]}))
            return None
        return self.take(text)

    def start(self, on_change: OnChange) -> None:
        self.on_change = on_change
        metrics.set_settings_valid(True)  # serving started with good settings
        threading.Thread(target=self.follow, name="settings", daemon=True).start()

    def follow(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.stopped.set()


class FileSettings(LiveSettings):
    """`serve --settings FILE`: the file re-read when its content changes (a ConfigMap volume swaps a symlink,
    an editor renames over it: the content is what is compared)."""

    def __init__(self, path: str, **kw):
        super().__init__(**kw)
        self.path = path
        self.where = path
        self._seen: str | None = None  # the first poll takes what is there (it may have changed since start-up)

    def read_text(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except OSError as e:
            raise Denied([doc_reason(f"cannot read settings file {self.path}: {e.strerror}")]) from None

    def follow(self) -> None:
        while not self.stopped.wait(POLL_SECONDS):
            try:
                text = self.read_text()
            except Denied as e:  # gone for a moment (being replaced): keep what is in use, say so once
                if self._seen != "unreadable":
                    log.warning(json.dumps({"msg": "settings file unreadable", "error": str(e)[:300]}))
                    self._seen = "unreadable"
                continue
            digest = hashlib.sha256(text).hexdigest()
            if digest != self._seen:
                self._seen = digest
                self.take(text)


class ConfigMapSettings(LiveSettings):
    """`serve --settings-configmap NS/NAME`: the key settings.json of one ConfigMap, read and watched through
    the API (RBAC: get, list and watch of that one ConfigMap, by name)."""

    def __init__(self, api_client, namespace: str, name: str, key: str = SETTINGS_KEY, **kw):
        from kubernetes import client

        super().__init__(**kw)
        self.core: Any = client.CoreV1Api(api_client)  # Any: the client types JSON answers as object
        self.namespace, self.name, self.key = namespace, name, key
        self.where = f"ConfigMap {namespace}/{name}"
        self.backoff = Backoff()

    def _text(self, configmap: dict | None) -> bytes:
        data = (configmap or {}).get("data") or {}
        if self.key not in data:
            raise Denied([doc_reason(f"{self.where} has no key {self.key!r}")])
        return data[self.key].encode()

    def read_text(self) -> bytes:
        metrics.get().api_requests.labels("get", "ConfigMap").inc()
        try:
            got = self.core.read_namespaced_config_map(self.name, self.namespace, _request_timeout=READ_TIMEOUT,
                                                       _preload_content=False)
        except Exception:
            metrics.get().api_errors.labels("get", "ConfigMap").inc()
            raise
        return self._text(json.loads(got.data))

    def follow(self) -> None:
        from kubernetes import watch

        selector = f"metadata.name={self.name}"
        while not self.stopped.is_set():
            try:
                metrics.get().api_requests.labels("list", "ConfigMap").inc()
                listed = self.core.list_namespaced_config_map(self.namespace, field_selector=selector,
                                                              _request_timeout=(5, 30), _preload_content=False)
                doc = json.loads(listed.data)
                items = doc.get("items") or []
                if items:
                    self._offer(items[0])
                version = (doc.get("metadata") or {}).get("resourceVersion")
                metrics.get().api_requests.labels("watch", "ConfigMap").inc()
                w = watch.Watch()
                try:
                    for event in w.stream(self.core.list_namespaced_config_map, self.namespace,
                                          field_selector=selector, resource_version=version,
                                          timeout_seconds=WATCH_SECONDS, _request_timeout=(5, WATCH_SECONDS + 30)):
                        if event.get("type") in ("ADDED", "MODIFIED"):
                            self._offer(event.get("raw_object") or {})
                        elif event.get("type") == "ERROR":
                            break  # expired: list again
                        if self.stopped.is_set():
                            return
                finally:
                    w.stop()
                self.backoff.reset()
            except Exception as e:  # keep serving the settings in use; retry later
                metrics.get().api_errors.labels("list/watch", "ConfigMap").inc()
                delay = self.backoff.next()
                log.warning(json.dumps({"msg": "settings watch failed", "source": self.where,
                                        "error": str(e)[:300], "retry_s": delay}))
                self.stopped.wait(delay)

    def _offer(self, configmap: dict) -> None:
        try:
            text = self._text(configmap)
        except Denied as e:
            metrics.set_settings_valid(False)
            log.error(json.dumps({"msg": "settings refused: the last good settings stay in use",
                                  "source": self.where, "error": str(e)[:2000]}))
            return
        self.take(text)


def fixed_repositories(given: str | None, settings: Settings) -> frozenset[str]:
    """`serve --publish-repositories` (None: the repository of the settings the server starts with), checked
    against those settings: raises Denied, so the server does not start with settings it would refuse live."""
    allowed = sources.parse_repositories(given) if given is not None else sources.repositories_of(settings)
    sources.check(settings, allowed)
    return allowed


def configmap_ref(text: str) -> tuple[str, str]:
    """NAMESPACE/NAME of `--settings-configmap`."""
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise Denied([doc_reason(f"--settings-configmap {text!r} is not NAMESPACE/NAME")])
    return namespace, name
