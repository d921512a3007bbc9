"""A worker's side of the runtime store (webhook.kube.store): read-only, each lookup one LMDB read transaction
(no lock, no copy but the value), the runtimes it reviews most kept decoded."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator

import lmdb
import orjson

from ..core.runtimes import KINDS, MAX_STORED_BYTES, Runtime, key
from .store import GENERATION, MAP_SIZE, STATE, SYNCED, kind_prefix, stored_key

DECODED_BYTES = 4 << 20  # what a worker keeps decoded (the runtimes it reviews most), counted in stored bytes
assert MAX_STORED_BYTES < DECODED_BYTES


class StoreReader:
    """A worker's side: read-only, opened after fork (an LMDB environment must not cross a fork). The store may
    not exist yet (the keeper's container starting): it is opened at the first read that finds it."""

    def __init__(self, directory: str, decoded_bytes: int = DECODED_BYTES, env: lmdb.Environment | None = None):
        """`env`: the writer's own, where one process holds both (tests; LMDB opens a directory once per process)."""
        self.directory = directory
        self._env = env
        self._decoded: OrderedDict[bytes, tuple[bytes, Runtime]] = OrderedDict()
        self._decoded_bytes, self._limit = 0, decoded_bytes
        self._lock = threading.Lock()

    @property
    def env(self) -> lmdb.Environment | None:
        if self._env is None and os.path.exists(os.path.join(self.directory, "data.mdb")):
            with self._lock:
                if self._env is None:
                    self._env = lmdb.open(self.directory, map_size=MAP_SIZE, subdir=True, readonly=True, lock=True,
                                          max_readers=512)
        return self._env

    def _get(self, k: bytes) -> bytes | None:
        env = self.env
        if env is None:
            return None
        with env.begin() as txn:
            return txn.get(k)

    def synced(self, kind: str) -> bool:
        return self._get(SYNCED + kind.encode()) is not None

    def state(self) -> dict:
        """The keeper's state (STATE), or {} before the keeper wrote one."""
        raw = self._get(STATE)
        return orjson.loads(raw) if raw else {}

    def get(self, kind: str, namespace: str, name: str) -> Runtime | None:
        k = key(kind, namespace, name)
        env = self.env
        if env is None:
            return None
        with env.begin() as txn:  # the generation and the runtime in one snapshot: a list whole, old or new
            generation = txn.get(GENERATION + kind.encode())
            raw = None if generation is None else txn.get(stored_key(k, generation))
        if raw is None:
            return None
        return self._decode(stored_key(k, b""), raw)

    def _decode(self, k: bytes, raw: bytes) -> Runtime:
        """The same Runtime object while its stored bytes do not change: what the rules decided of it is
        kept with it (Runtime.memo), as in a worker's own cache."""
        with self._lock:
            hit = self._decoded.get(k)
            if hit is not None and hit[0] == raw:
                self._decoded.move_to_end(k)
                return hit[1]
        runtime = Runtime.from_bytes(raw)
        with self._lock:
            old = self._decoded.pop(k, None)
            if old is not None:
                self._decoded_bytes -= len(old[0])
            self._decoded[k] = (raw, runtime)
            self._decoded_bytes += len(raw)
            while self._decoded_bytes > self._limit:
                _, (gone, _) = self._decoded.popitem(last=False)
                self._decoded_bytes -= len(gone)
        return runtime

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """(`kind \\x1f namespace \\x1f name`, stored bytes) of every runtime read, from one snapshot."""
        env = self.env
        if env is None:
            return
        with env.begin() as txn:
            for kind in KINDS:
                generation = txn.get(GENERATION + kind.encode())
                if generation is None:
                    continue
                prefix = kind_prefix(kind) + generation + b"\x1f"
                cursor = txn.cursor()
                found = cursor.set_range(prefix)
                while found:
                    k, v = cursor.item()
                    if not k.startswith(prefix):
                        break
                    yield kind_prefix(kind) + k[len(prefix):], v
                    found = cursor.next()

    def __len__(self) -> int:
        return sum(1 for _ in self.items())

    def __iter__(self) -> Iterator[Runtime]:
        for _, v in self.items():
            yield Runtime.from_bytes(v)

