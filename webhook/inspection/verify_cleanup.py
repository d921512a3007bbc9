"""`verify` (SPEC 9): what a run may leave in the cluster, when another run may take it away, and how many
probes one run may make.

Every probe carries the label PROBE_LABEL, RUN_LABEL (its run's id), an entry of VERIFY_MANAGER in its
runtimePatches, and TTL_ANNOTATION: the seconds after its creationTimestamp past which no verify follows it
any more. A probe left behind (verify killed by SIGKILL, its machine gone, `--keep`) is removed by
`verify --cleanup`, or by the next verify in its namespace, once it has expired. The creation time and
"now" both come from the API server (its `Date` header), so the clocks of the machines running verify do
not matter. The deletes carry the probe's UID as a precondition: an object of the same name made since by
someone else is never deleted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

from .verify import find_entry
from .verify_probe import PROBE_LABEL, RUN_LABEL, TTL_ANNOTATION, VERIFY_MANAGER

# Past the longest a verify still follows its probe (--timeout, then the wait for its delete): for an API
# server that answers slowly, or a verify stopped for a while (Ctrl-Z).
TTL_MARGIN = 300
# A kept probe (--keep) is there to be looked at: an hour, then another run may remove it.
KEPT_TTL = 3600
# A probe whose annotation is absent or unreadable (made by an older verify, or edited): a day after it was made.
FALLBACK_TTL = 86400
# Probes one run may make unless --max-probes says more. Each probe's pods ask for what the runtime's pods
# do (8 GPUs, say): without a cap `--per-node` on a 500-node cluster would hold every GPU of it at once.
MAX_PROBES = 10
# Non-extended resources, left out of what a cap refusal says each probe asks for.
_BASIC_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def probe_ttl(timeout: float, cleanup_wait: float, keep: bool) -> int:
    """The TTL a run writes on its probes: past its own end (the timeout, then the delete and the wait
    for it), or an hour more when the probes are kept."""
    return math.ceil(timeout + cleanup_wait + TTL_MARGIN + (KEPT_TTL if keep else 0))


def server_now(date_header: str | None) -> datetime | None:
    """The API server's clock, from an answer's `Date` header (RFC 7231)."""
    try:
        moment = parsedate_to_datetime(date_header or "")
    except (TypeError, ValueError, IndexError):
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _created(obj: dict[str, Any]) -> datetime | None:
    text = (obj.get("metadata") or {}).get("creationTimestamp") or ""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def ttl_of(obj: dict[str, Any]) -> int:
    text = ((obj.get("metadata") or {}).get("annotations") or {}).get(TTL_ANNOTATION)
    try:
        ttl = int(str(text))
    except ValueError:
        return FALLBACK_TTL
    return ttl if ttl > 0 else FALLBACK_TTL


def is_probe(obj: dict[str, Any]) -> bool:
    """A TrainJob verify made: its label, and its own manager's entry (a label alone is easily put on a
    TrainJob that is no probe)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(PROBE_LABEL) == "probe" and find_entry(obj, VERIFY_MANAGER) is not None


@dataclass(frozen=True)
class Leftover:
    namespace: str
    name: str
    uid: str
    run: str
    expires: datetime | None  # None: no creation time to count from (never removed)
    expired: bool

    def as_json(self, removed: bool | None = None) -> dict[str, Any]:
        out = {"namespace": self.namespace, "name": self.name, "run": self.run,
               "expires": self.expires.strftime("%Y-%m-%dT%H:%M:%SZ") if self.expires else None,
               "expired": self.expired}
        if removed is not None:
            out["removed"] = removed
        return out


def leftovers(items: list[dict[str, Any]], now: datetime) -> list[Leftover]:
    """The probes among `items` (TrainJobs), each with whether it has expired at `now` (the server's time)."""
    out = []
    for obj in items:
        if not is_probe(obj):
            continue
        meta = obj.get("metadata") or {}
        created = _created(obj)
        expires = created + timedelta(seconds=ttl_of(obj)) if created is not None else None
        out.append(Leftover(str(meta.get("namespace") or ""), str(meta.get("name") or ""), str(meta.get("uid") or ""),
                            str((meta.get("labels") or {}).get(RUN_LABEL) or ""), expires,
                            expires is not None and now >= expires))
    return sorted(out, key=lambda p: (p.namespace, p.name))


def runtime_asks(runtime: dict[str, Any]) -> str:
    """The extended resources (GPUs and the like) the runtime's containers ask for, as `name: quantity`."""
    asks: dict[str, str] = {}
    spec = ((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}
    for job in spec.get("replicatedJobs") or []:
        pod = ((((job or {}).get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
            res = (c or {}).get("resources") or {}
            for kind in ("limits", "requests"):
                for name, qty in (res.get(kind) or {}).items():
                    if name not in _BASIC_RESOURCES:
                        asks.setdefault(name, str(qty))
    return ", ".join(f"{k}: {v}" for k, v in sorted(asks.items()))


def over_cap(probes: int, cap: int, asks: str) -> str | None:
    """Why a run of `probes` probes is refused under the cap, or None when it fits."""
    if probes <= cap:
        return None
    each = f" (each asks for what the runtime's pods do: {asks})" if asks else \
        " (each asks for what the runtime's pods do)"
    return (f"--per-node would make {probes} probes, one per schedulable node, more than --max-probes {cap}{each}: "
            f"pass --max-probes {probes} to probe them all")


REMOVED, KEPT, GONE = "removed", "kept", "gone"


def render_cleanup(results: list[tuple[Leftover, str]], where: str, output: str = "table") -> str:
    """`verify --cleanup`'s report: each probe found and what became of it (`removed`; `kept`: not expired;
    `gone`: another object has its name now, left alone; else the reason its delete failed)."""
    if output == "json":
        return json.dumps([dict(p.as_json(), result=r) for p, r in results], indent=2) + "\n"
    rows = [("NAMESPACE", "PROBE", "RUN", "EXPIRES", "RESULT")]
    for p, result in results:
        expires = p.expires.strftime("%Y-%m-%dT%H:%M:%SZ") if p.expires else "-"
        if result == KEPT:
            result = "kept: not expired (a verify may still follow it)"
        rows.append((p.namespace, p.name, p.run or "-", expires, result))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
             for r in rows] if results else []
    removed = sum(r == REMOVED for _, r in results)
    summary = f"removed {removed} of {len(results)} probes {where}"
    if any(r == KEPT for _, r in results):
        summary += "; to remove a probe that has not expired: kubectl delete trainjob -n NAMESPACE PROBE"
    return "\n".join(lines + [summary]) + "\n"
