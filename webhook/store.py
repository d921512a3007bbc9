"""The runtime cache of a pod, in one place for all its workers: an LMDB environment in a directory.

One process per pod (the keeper, `webhook.cluster.Keeper`, forked by serve's master) lists and watches
the runtimes and writes them here; every gunicorn worker maps the same file read-only. The cache is held
once per pod, not once per worker, and a worker reads a runtime in a few microseconds without a call to
another process (LMDB readers take no lock and copy nothing but the value).

Keys are `kind \\x1f namespace \\x1f name`; values are `Runtime.to_bytes()`. Keys starting with NUL are the
store's own: which kinds have completed a first list.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Iterable, Iterator

import lmdb

from .core.runtimes import Key, Runtime, key, key_of

# Address space, not memory: only the pages written are used. 10,000 ordinary runtimes take about 8 MiB;
# one runtime is stored in at most a little over MAX_STORED_BYTES (64 KiB): a larger one is held as too large.
MAP_SIZE = 8 << 30
SYNCED = b"\0synced\x1f"
DECODED_BYTES = 4 << 20  # what a worker keeps decoded (the runtimes it reviews most), counted in stored bytes


def _key_bytes(k: Key) -> bytes:
    return "\x1f".join(k).encode()


def _prefix(kind: str) -> bytes:
    return kind.encode() + b"\x1f"


class StoreWriter:
    """The keeper's side: the only writer. It takes the calls a Reflector makes of an index."""

    def __init__(self, directory: str):
        self.env = lmdb.open(directory, map_size=MAP_SIZE, subdir=True, sync=False, metasync=False,
                             max_readers=512)
        self._lock = threading.Lock()  # one write transaction at a time from this process's threads

    def put(self, obj) -> Runtime:
        runtime = Runtime.of(obj)
        with self._lock, self.env.begin(write=True) as txn:
            txn.put(_key_bytes(runtime.key), runtime.to_bytes())
        return runtime

    def delete(self, obj) -> None:
        with self._lock, self.env.begin(write=True) as txn:
            txn.delete(_key_bytes(key_of(obj)))

    def replace(self, kind: str, objs: Iterable) -> int:
        """A fresh list of one kind, in one transaction (readers see the old list or the new, whole), and the
        kind marked as listed; `objs` may be a generator reading pages: each is written as it comes."""
        prefix, fresh = _prefix(kind), set()
        with self._lock, self.env.begin(write=True) as txn:
            for runtime in (Runtime.of(o, kind) for o in objs):
                k = _key_bytes(runtime.key)
                txn.put(k, runtime.to_bytes())
                fresh.add(k)
            cursor = txn.cursor()
            stale = []
            if cursor.set_range(prefix):
                for k in cursor.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    if k not in fresh:
                        stale.append(k)
            for k in stale:
                txn.delete(k)
            txn.put(SYNCED + kind.encode(), b"1")
        return len(fresh)

    def count(self, kind: str) -> int:
        prefix, n = _prefix(kind), 0
        with self.env.begin() as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for k in cursor.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    n += 1
        return n

    def reader_check(self) -> int:
        """Free the reader slots of workers that died in a read (LMDB keeps them until asked)."""
        return self.env.reader_check()


class StoreReader:
    """A worker's side: read-only, opened after fork (an LMDB environment must not cross a fork)."""

    def __init__(self, directory: str, decoded_bytes: int = DECODED_BYTES, env: lmdb.Environment | None = None):
        """`env`: the writer's own, where one process holds both (tests; LMDB opens a directory once per process)."""
        self.env = env or lmdb.open(directory, map_size=MAP_SIZE, subdir=True, readonly=True, lock=True,
                                    max_readers=512)
        self._decoded: OrderedDict[bytes, tuple[bytes, Runtime]] = OrderedDict()
        self._decoded_bytes, self._limit = 0, decoded_bytes
        self._lock = threading.Lock()

    def synced(self, kind: str) -> bool:
        with self.env.begin() as txn:
            return txn.get(SYNCED + kind.encode()) is not None

    def get(self, kind: str, namespace: str, name: str) -> Runtime | None:
        k = _key_bytes(key(kind, namespace, name))
        with self.env.begin() as txn:
            raw = txn.get(k)
        if raw is None:
            return None
        return self._decode(k, raw)

    def _decode(self, k: bytes, raw: bytes) -> Runtime:
        """The same Runtime object while its stored bytes do not change: what the rules decided of it is
        kept with it (Runtime.memo), as in a worker's own cache."""
        with self._lock:
            hit = self._decoded.get(k)
            if hit is not None and hit[0] == raw:
                self._decoded.move_to_end(k)
                return hit[1]
        runtime = Runtime.from_bytes(raw)
        if len(raw) > self._limit:
            return runtime
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
        """(key, stored bytes) of every runtime, from one snapshot."""
        with self.env.begin() as txn:
            for k, v in txn.cursor():
                if not k.startswith(b"\0"):
                    yield k, v

    def __len__(self) -> int:
        return sum(1 for _ in self.items())

    def __iter__(self) -> Iterator[Runtime]:
        for k, v in self.items():
            yield Runtime.from_bytes(v)


def prepare(directory: str | None) -> str:
    """The store's directory, emptied of an earlier container's store (`directory`, serve --runtime-store: the
    pod's own volume), or a fresh private one (None: the caller removes it at exit). The files are made here,
    before any worker opens them."""
    import tempfile

    if directory:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for name in ("data.mdb", "lock.mdb"):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    else:
        directory = tempfile.mkdtemp(prefix="dispatch-admission-runtimes-")
    os.chmod(directory, 0o700)
    StoreWriter(directory).env.close()
    return directory
