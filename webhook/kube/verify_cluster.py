"""The API calls `verify` and `verify --cleanup` make, with the official client (`Cluster`), and how their
failures read (`Unusable`: verify cannot run, exit 2 with the reason in one line). `webhook.inspection.verify`
judges what these calls read (`verify_probe` makes the probe); `webhook.commands.verify` wires the two and prints."""

from __future__ import annotations

from typing import Any

from ..core.runtimes import GROUP, VERSION
from ..inspection.verify_probe import JOBSET_NAME_LABEL, PROBE_LABEL

TIMEOUT = (5, 30)            # connect, read: for every call
# A metadata-only read: whether a Secret exists, never its data.
METADATA_ONLY = {"Accept": "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"}


class Unusable(Exception):
    """verify cannot run (the cluster, the runtime, the namespace): exit 2 with the reason in one line."""


def api_error(e) -> str:
    """The API server's own message from an ApiException (its Status body), else its status line."""
    import json

    try:
        body = json.loads(e.body)
        if body.get("message"):
            return body["message"]
    except (TypeError, ValueError, AttributeError):
        pass
    return f"{e.status} {e.reason}"


def answered(e: Exception) -> str | None:
    """The API server's message when `e` is its answer (an ApiException), else None (unreachable, TLS, a timeout)."""
    from kubernetes.client.exceptions import ApiException

    return api_error(e) if isinstance(e, ApiException) else None


def fault(what: str, e: Exception) -> Unusable:
    from kubernetes.client.exceptions import ApiException

    if isinstance(e, ApiException):
        return Unusable(f"{what}: {api_error(e)}")
    return Unusable(f"{what}: {type(e).__name__}: {str(e)[:300]}")


class Cluster:
    """The API calls verify makes, with the official client."""

    def __init__(self, kubeconfig: str | None):
        from kubernetes import client

        from .client import api_client

        try:
            self.client = api_client(kubeconfig, prefer_kubeconfig=True)
        except Exception as e:
            raise Unusable(f"no cluster to talk to: {type(e).__name__}: {str(e)[:300]}") from None
        # Any: the client types JSON answers as object.
        self.custom: Any = client.CustomObjectsApi(self.client)
        self.core: Any = client.CoreV1Api(self.client)

    def default_namespace(self, kubeconfig: str | None) -> str:
        """The kubeconfig context's namespace, else the pod's own (in a cluster), else `default`."""
        from kubernetes import config

        try:
            _, active = config.list_kube_config_contexts(config_file=kubeconfig)
            ns = (active or {}).get("context", {}).get("namespace")
            if ns:
                return ns
        except Exception:  # no kubeconfig: in-cluster
            pass
        try:
            with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f:
                return f.read().strip() or "default"
        except OSError:
            return "default"

    def runtime(self, kind: str, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        from .runtime_api import read_runtime

        try:
            return read_runtime(self.custom, kind, namespace, name, TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            raise fault(f"cannot read {kind} {name}", e) from None
        except Exception as e:
            raise fault(f"cannot read {kind} {name}", e) from None

    def nodes(self) -> list[dict]:
        try:
            got = self.core.list_node(_request_timeout=TIMEOUT, _preload_content=False)
        except Exception as e:
            raise fault("cannot list nodes (--per-node)", e) from None
        return _json(got).get("items") or []

    def create(self, namespace: str, trainjob: dict, dry_run: bool = False) -> dict:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "trainjobs", trainjob,
                                                           dry_run="All" if dry_run else None,
                                                           _request_timeout=TIMEOUT)

    def probes(self, namespace: str | None) -> tuple[list[dict], str | None]:
        """Every TrainJob labelled as a probe in `namespace` (None: every namespace), and the server's `Date`."""
        items: list[dict]
        items, token, date = [], None, None
        while True:
            kw = {"label_selector": PROBE_LABEL, "limit": 500, "_request_timeout": TIMEOUT,
                  "_preload_content": False, **({"_continue": token} if token else {})}
            got = (self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "trainjobs", **kw)
                   if namespace else self.custom.list_cluster_custom_object(GROUP, VERSION, "trainjobs", **kw))
            date = date or got.headers.get("Date")
            page = _json(got)
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items, date

    def secret_exists(self, namespace: str, name: str) -> tuple[bool | None, str]:
        """(True or False, "") when the API server says; (None, why) when it cannot be told (RBAC, a fault)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.read_namespaced_secret(name, namespace, _headers=METADATA_ONLY, _preload_content=False,
                                             _request_timeout=TIMEOUT)
            return True, ""
        except ApiException as e:
            return (False, "") if e.status == 404 else (None, api_error(e))
        except Exception as e:
            return None, f"{type(e).__name__}: {str(e)[:200]}"

    def trainjob(self, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "trainjobs", name,
                                                            _request_timeout=TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def pods(self, namespace: str, name: str) -> list[dict]:
        got = self.core.list_namespaced_pod(namespace, label_selector=f"{JOBSET_NAME_LABEL}={name}",
                                            _request_timeout=TIMEOUT, _preload_content=False)
        return _json(got).get("items") or []

    def events(self, namespace: str, pod: str) -> list[dict]:
        got = self.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}",
                                              _request_timeout=TIMEOUT, _preload_content=False)
        return _json(got).get("items") or []

    def log_tail(self, namespace: str, pod: str, container: str, previous: bool, lines: int) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.core.read_namespaced_pod_log(pod, namespace, container=container, previous=previous,
                                                     tail_lines=lines, _request_timeout=TIMEOUT)
        except ApiException as e:
            return f"(the output cannot be read: {api_error(e)})"
        except Exception as e:
            return f"(the output cannot be read: {type(e).__name__})"

    def delete(self, namespace: str, name: str, uid: str) -> bool:
        """Delete the TrainJob `name` if it is still the object `uid`; False when another object has the name
        now (the precondition failed: it is left alone). Gone already is deleted."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        # Background, not Foreground: while a foreground delete waits on its JobSet, Trainer (v2.3.0) makes
        # the JobSet again for the TrainJob still there, and the probe's pods come back (seen on the node).
        options = client.V1DeleteOptions(propagation_policy="Background", preconditions=client.V1Preconditions(uid=uid))
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "trainjobs", name, body=options,
                                                        _request_timeout=TIMEOUT)
        except ApiException as e:
            if e.status == 409:  # "Precondition failed: UID in precondition: ..., UID in object meta: ..."
                return False
            if e.status != 404:
                raise
        return True


def _json(response) -> dict:
    import json

    return json.loads(response.data)
