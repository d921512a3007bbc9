"""What each namespace's runtimes take in the runtime store (webhook.kube.store), in stored bytes (their keys and
values), counted by the writes: a namespace's TrainingRuntimes are held in full up to its share; past it a runtime
is held as its name and the reason (issue 47)."""

from __future__ import annotations

from ..core.runtimes import NAMESPACED_KIND, Runtime

SHARE_WORDS = "would pass the namespace's share of"  # in the reason of a runtime held as over its namespace's share


class Share:
    """A namespace's TrainingRuntimes held in full up to `limit` stored bytes; past it, a runtime is held as its
    name and the reason. `held` is what each namespace's runtimes take (their keys and values)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held: dict[str, int] = {}

    def value(self, runtime: Runtime, stored_key: bytes, replaced: int = 0) -> bytes:
        """What to store for `runtime`, replacing `replaced` bytes of its namespace's; counted in `held`."""
        value = runtime.to_bytes()
        size = len(stored_key) + len(value)
        if runtime.kind == NAMESPACED_KIND:
            ns = runtime.namespace
            others = self.held.get(ns, 0) - replaced
            if others + size > self.limit:
                value = Runtime(runtime.kind, ns, runtime.name, runtime.version, oversize=(
                    f"its namespace {ns} holds {others:,} bytes of TrainingRuntimes, and this one's {size:,}"
                    f" {SHARE_WORDS} {self.limit:,} bytes")).to_bytes()
            self.held[ns] = others + len(stored_key) + len(value)
        return value

    def release(self, kind: str, namespace: str, size: int) -> None:
        if kind == NAMESPACED_KIND:
            left = self.held.get(namespace, 0) - size
            if left > 0:
                self.held[namespace] = left
            else:
                self.held.pop(namespace, None)


def over_share(value: bytes) -> bool:
    """Whether a stored runtime is held as over its namespace's share (then it is small: its name and the reason)."""
    return len(value) < 2048 and SHARE_WORDS in Runtime.from_bytes(value).oversize


class Written:
    """What a list has written so far into its generation."""

    def __init__(self, kind: str, generation: bytes):
        self.kind, self.generation = kind, generation
        self.switched = False
        self.held = self.not_held = self.over_share = 0
        self.namespaces: dict[str, int] = {}
        self.over_namespaces: dict[str, int] = {}

    def took(self, batch: list[tuple[bytes, bytes]]) -> None:
        for k, v in batch:
            namespace = k.split(b"\x1f", 3)[2].decode()
            self.held += 1
            self.namespaces[namespace] = self.namespaces.get(namespace, 0) + len(k) + len(v)
            if over_share(v):
                self.over_share += 1
                self.over_namespaces[namespace] = self.over_namespaces.get(namespace, 0) + 1
