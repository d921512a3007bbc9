"""Where the settings' credentials may be mounted (SPEC 2): what the Schema cannot say of them.

Each credential's name is unique, and its mount path overlaps (is at, under or an ancestor of) neither another
credential's, nor /opt/dispatch (the publish mount's), nor a path Trainer's plugins mount.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any

from . import paths
from .errors import ErrInvalid, Reasons

# What Trainer v2.3.0's plugins mount into the pods after the runtimePatches are merged (SPEC 2). Trainer matches
# mounts by path, so a credential overlapping one of these would silently replace it or be replaced (found: a
# credential at /etc/mpi vanished from an MPI launcher).
TRAINER_PLUGIN_PATHS: tuple[tuple[str, str], ...] = (
    ("/etc/mpi", "MPI (the hostfile)"),
    ("/etc/flux-config", "Flux"),
    ("/curve", "Flux"),
    ("/mnt/flux", "Flux"),
    ("/dev/shm", "Flux"),
    ("/opt/software", "Flux"),
    ("/var/run/secrets/kubeflow/trainer", "trainjob-status"),
)

# Overlapping mount paths named at most (a credential overlapping thousands of others is one mistake, not
# thousands): the check stays linear in the credentials, not in their pairs.
OVERLAPS_NAMED = 20


def credential_reasons(doc: dict[str, Any], reasons: Reasons) -> None:
    """What the Schema cannot say: unique credential names, mount paths that overlap."""
    creds = doc.get("credentials")
    if not isinstance(creds, list):
        return
    # Only well-typed entries are compared; the Schema has already named the others.
    creds = [c if isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("mountPath"), str)
             else {"name": None, "mountPath": None} for c in creds]
    overlapping, more = overlapping_mounts([c["mountPath"] for c in creds])
    seen_names: dict[str, int] = {}
    for i, cred in enumerate(creds):
        name, mount = cred["name"], cred["mountPath"]
        if name is None:
            continue
        if name in seen_names:
            reasons.add(ErrInvalid, f"credentials[{i}].name",
                        f"{name!r} is already used by credentials[{seen_names[name]}]")
        seen_names.setdefault(name, i)
        if paths.overlaps(mount, paths.PUBLISH_DIR):
            reasons.add(ErrInvalid, f"credentials[{i}].mountPath",
                        f"{mount!r} overlaps {paths.PUBLISH_DIR}, which is reserved for the publish mount")
        for plugin_path, plugin in TRAINER_PLUGIN_PATHS:
            if paths.overlaps(mount, plugin_path):
                reasons.add(ErrInvalid, f"credentials[{i}].mountPath",
                            f"{mount!r} overlaps {plugin_path}, which Trainer's {plugin} plugin mounts after the"
                            " runtimePatches merge: choose a path outside it")
        for j in sorted(overlapping.get(i, ())):
            reasons.add(ErrInvalid, f"credentials[{i}].mountPath",
                        f"{mount!r} overlaps credentials[{j}].mountPath {creds[j]['mountPath']!r}")
    if more:
        reasons.add(ErrInvalid, "credentials",
                    f"{more} more pairs of overlapping mountPaths (the first {OVERLAPS_NAMED} are named)")


def overlapping_mounts(mounts: Sequence[str | None]) -> tuple[dict[int, list[int]], int]:
    """For mount path i, the earlier ones j that overlap it (at, under or above it), at most OVERLAPS_NAMED pairs
    in all, and how many pairs more (None: a path not to compare). Sorted by their components, a path's
    descendants follow it, so a walk keeping the chain of ancestors finds every pair once: O(n log n) and the
    pairs named, where comparing each pair took 15 s for 4,000 credentials."""
    parts = sorted((_components(m), i) for i, m in enumerate(mounts) if m is not None)
    found: dict[int, list[int]] = {}
    named, more = 0, 0
    chain: list[tuple[tuple[str, ...], list[int]]] = []  # ancestors of the current path (and itself), each group
    ancestors = 0                                         # the indices held in `chain`
    for comps, i in parts:
        while chain and comps[:len(chain[-1][0])] != chain[-1][0]:
            ancestors -= len(chain.pop()[1])
        if not chain or chain[-1][0] != comps:
            chain.append((comps, []))
        room = min(ancestors, OVERLAPS_NAMED - named)
        for j in islice((j for _, group in chain for j in group), room):  # never more than the room: linear
            found.setdefault(max(i, j), []).append(min(i, j))
        named, more = named + room, more + ancestors - room
        chain[-1][1].append(i)
        ancestors += 1
    return found, more


def _components(mount: str) -> tuple[str, ...]:
    normal = paths.normalise(mount)
    return () if normal == "/" else tuple(normal[1:].split("/"))
