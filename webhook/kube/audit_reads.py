"""The list calls `dispatch-admission audit` makes (SPEC 8.2), with the official client: the runtimes and
TrainJobs in pages (`limit`/`continue`), and which of the credentials' Secrets exist (metadata only: never their
data). Nothing is written here; `webhook.inspection.audit` judges what these read.

Runtimes are held as the rules read them (names and paths, bounded per runtime), never as the objects listed;
TrainJobs come a page at a time, so 50,000 of them fit in bounded memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ..core.runtimes import CLUSTER_KIND, GROUP, KINDS, PLURALS, TRAINJOB_KIND, VERSION, Key, RuntimeIndex

# A metadata-only list: which Secrets exist, never their data.
METADATA_LIST = {"Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"}


class ClusterUnreadable(Exception):
    """The cluster cannot be read (no kubeconfig, unreachable, forbidden): exit 2 with the reason."""

    def __init__(self, message: str, missing_crds: bool = False):
        super().__init__(message)
        self.missing_crds = missing_crds  # OpenReports' CRDs: no report can be written at all


class AuditReads:
    """The audit's connection and the list calls it makes on it."""

    def __init__(self, kubeconfig: str | None):
        from kubernetes import client

        from .client import api_client

        try:
            self.connection = api_client(kubeconfig, prefer_kubeconfig=True)
        except Exception as e:
            raise ClusterUnreadable(f"{type(e).__name__}: {str(e)[:300]}") from None
        self.custom: Any = client.CustomObjectsApi(self.connection)  # Any: the client types JSON answers as object

    def runtimes(self, namespace: str | None, limit: int) -> tuple[RuntimeIndex, dict[Key, str]]:
        return taken_runtimes(self.custom, namespace, limit)

    def trainjobs(self, namespace: str | None, limit: int) -> Iterator[tuple[list[dict], int | None]]:
        return pages(self.custom, TRAINJOB_KIND, namespace, limit)

    def secrets(self, wanted: dict[str, set[str]], namespace: str | None, limit: int) -> set[tuple[str, str]]:
        """ClusterUnreadable without the right to list Secrets (the caller says so and goes on)."""
        from kubernetes import client

        core: Any = client.CoreV1Api(self.connection)  # Any: the client types JSON answers as object
        return existing_secrets(core, wanted, namespace, limit)


def pages(api, kind: str, namespace: str | None, limit: int) -> Iterator[tuple[list[dict], int | None]]:
    """(items, remaining count or None) per list call, following `continue` to the end."""
    from kubernetes.client.exceptions import ApiException

    token = None
    while True:
        kw = {"limit": limit, "_request_timeout": (5, 60)}
        if token:
            kw["_continue"] = token
        try:
            if namespace and kind != CLUSTER_KIND:
                got = api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURALS[kind], **kw)
            else:
                got = api.list_cluster_custom_object(GROUP, VERSION, PLURALS[kind], **kw)
        except ApiException as e:
            raise ClusterUnreadable(f"list {PLURALS[kind]}: {e.status} {e.reason}") from None
        except Exception as e:  # unreachable, TLS, timeouts
            raise ClusterUnreadable(f"list {PLURALS[kind]}: {type(e).__name__}: {str(e)[:300]}") from None
        meta = got.get("metadata") or {}
        yield [dict(i, kind=i.get("kind") or kind) for i in got.get("items") or []], meta.get("remainingItemCount")
        token = meta.get("continue")
        if not token:
            return


def taken_runtimes(api, namespace: str | None, limit: int) -> tuple[RuntimeIndex, dict[Key, str]]:
    """The runtimes, a page at a time, as the rules read them, and each one's uid (what a report names): no raw
    object is held past its page (a TrainingRuntime may be 1.5 MB of JSON; Runtime keeps its names and paths)."""
    index, uids = RuntimeIndex(), {}
    for kind in KINDS:
        for items, _ in pages(api, kind, namespace, limit):
            for obj in items:
                uids[index.put(obj).key] = uid_of(obj)
    return index, uids


def uid_of(obj: dict) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


def existing_secrets(core_api, wanted: dict[str, set[str]], namespace: str | None,
                     limit: int) -> set[tuple[str, str]]:
    """(namespace, name) of each Secret in `wanted` (name: the namespaces that mount it) that exists."""
    from kubernetes.client.exceptions import ApiException

    present: set[tuple[Any, str]] = set()  # (namespace as the API gives it, name)
    for secret in sorted(wanted):
        token = None
        while True:
            kw = {"field_selector": f"metadata.name={secret}", "limit": limit, "_headers": METADATA_LIST,
                  "_preload_content": False, "_request_timeout": (5, 60), **({"_continue": token} if token else {})}
            try:
                got = json.loads((core_api.list_namespaced_secret(namespace, **kw) if namespace
                                  else core_api.list_secret_for_all_namespaces(**kw)).data)
            except ApiException as e:
                raise ClusterUnreadable(f"list secrets: {e.status} {e.reason}") from None
            except Exception as e:
                raise ClusterUnreadable(f"list secrets: {type(e).__name__}: {str(e)[:300]}") from None
            present |= {((i.get("metadata") or {}).get("namespace"), secret) for i in got.get("items") or []}
            token = (got.get("metadata") or {}).get("continue")
            if not token:
                break
    return present
