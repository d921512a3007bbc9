"""`dispatch-admission verify --cleanup`, and the sweep every verify makes before its first probe: remove the
probes whose TTL has passed (`inspection.verify_cleanup` decides which), each delete carrying the probe's UID as a
precondition, so an object made since under the same name is left alone.

Calls: list of TrainJobs labelled `dispatch.go.phpboyscout.uk/verify` (in NS, or in every namespace with
--all-namespaces), and delete of the expired ones. "Now" is the API server's (the list's `Date` header).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO

from ..inspection import verify_cleanup as core
from ..kube.verify_cluster import Cluster, fault


def sweep(cluster: Cluster, namespace: str | None) -> list[tuple[core.Leftover, str]]:
    """Every probe found, with what became of it: removed, kept (not expired), gone, or why its delete failed."""
    items, date = cluster.probes(namespace)
    now = core.server_now(date) or datetime.now(UTC)
    out = []
    for p in core.leftovers(items, now):
        if not p.expired:
            out.append((p, core.KEPT))
            continue
        try:
            out.append((p, core.REMOVED if cluster.delete(p.namespace, p.name, p.uid) else core.GONE))
        except Exception as e:
            out.append((p, f"not removed: {fault('delete', e)}"))
    return out


def sweep_before_run(cluster: Cluster, namespace: str, err: IO[str]) -> None:
    """The expired probes of earlier runs in the namespace go before this run makes its own; only what was
    removed, or could not be, is said (on stderr). Housekeeping: a user who may not list TrainJobs there
    goes without it, unsaid (the create that follows says what they may not do)."""
    try:
        results = sweep(cluster, namespace)
    except Exception:
        return
    removed = [p.name for p, r in results if r == core.REMOVED]
    failed = [f"{p.name} ({r})" for p, r in results if r not in (core.REMOVED, core.KEPT, core.GONE)]
    if removed:
        err.write(f"verify: removed {len(removed)} expired probes in namespace {namespace}: {', '.join(removed)}\n")
    if failed:
        err.write(f"verify: expired probes left in namespace {namespace}: {'; '.join(failed)}\n")


@dataclass
class Options:
    namespace: str | None = None
    all_namespaces: bool = False
    kubeconfig: str | None = None
    output: str = "table"


def run(opts: Options, out: IO[str], cluster: Cluster | None = None) -> int:
    """Exit 0 when every expired probe is gone, 1 when a delete failed; Unusable (2) when the probes cannot be
    listed."""
    cluster = cluster or Cluster(opts.kubeconfig)
    namespace = None if opts.all_namespaces else (opts.namespace or cluster.default_namespace(opts.kubeconfig))
    where = f"in namespace {namespace}" if namespace else "in every namespace"
    try:
        results = sweep(cluster, namespace)
    except Exception as e:
        raise fault(f"cannot list TrainJobs {where}", e) from None
    out.write(core.render_cleanup(results, where, opts.output))
    return 0 if all(r in (core.REMOVED, core.KEPT, core.GONE) for _, r in results) else 1

