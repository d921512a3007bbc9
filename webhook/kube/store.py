"""The runtime cache of a pod, in one place for all its workers: an LMDB environment in a directory.

One process per pod writes it: the runtime keeper (`webhook.kube.keeper`, `dispatch-admission keep`), in a
container of its own in the cluster (a native sidecar sharing the store's volume) or a process `serve`
starts locally. Every gunicorn worker of the serving container maps the same file read-only. The cache is
held once per pod, and a worker reads a runtime in a few microseconds without a call to another process
(LMDB readers take no lock and copy nothing but the value).

The store outlives the keeper: a keeper that restarts (an OOM kill, a node's pressure) leaves the last
synced store to the workers, which go on answering from it and say how old it is; the new keeper lists
again into it. LMDB's copy-on-write keeps it whole whatever point the writer dies at.

Keys are `kind \\x1f namespace \\x1f name`; values are `Runtime.to_bytes()`. Keys starting with NUL are the
store's own: which kinds have completed a first list, and the keeper's state (`STATE`: when each kind was last
confirmed, how often the keeper started, its requests and errors), which the serving container exports.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

import lmdb
import orjson

from ..core.runtimes import MAX_STORED_BYTES, Key, Runtime, key, key_of

# The store's hard ceiling: LMDB never grows its file past it (a write past it fails, and is counted). One runtime
# is stored in at most MAX_STORED_BYTES and a little (a larger one is held as too large to check, in a few hundred
# bytes), and 10,000 ordinary runtimes take about 8 MiB: 512 MiB is thousands of runtimes at the bound. The chart's
# ephemeral-storage limit and the volume's sizeLimit are above it, so no tenant can get the pod evicted through it.
MAP_SIZE = 512 << 20
SYNCED = b"\0synced\x1f"
STATE = b"\0state"
DECODED_BYTES = 4 << 20  # what a worker keeps decoded (the runtimes it reviews most), counted in stored bytes
assert MAX_STORED_BYTES < DECODED_BYTES


def _key_bytes(k: Key) -> bytes:
    return "\x1f".join(k).encode()


def _prefix(kind: str) -> bytes:
    return kind.encode() + b"\x1f"


class StoreFull(Exception):
    """The store reached MAP_SIZE: the runtime was not written (the workers confirm it with a live read)."""


class StoreWriter:
    """The keeper's side: the only writer. It takes the calls a Reflector makes of an index, and keeps a count
    per kind as it writes, so a watch event costs the same whatever the number of runtimes."""

    def __init__(self, directory: str, map_size: int = MAP_SIZE):
        self.env = lmdb.open(directory, map_size=map_size, subdir=True, sync=False, metasync=False,
                             max_readers=512)
        self._lock = threading.Lock()  # one write transaction at a time from this process's threads
        self._counts: dict[str, int] = {}
        # Called in a list's transaction with (kind, runtimes listed): the keeper's state to write with it, so a
        # worker that sees the kind listed sees the state that says so (webhook.kube.keeper).
        self.on_listed: Callable[[str, int], dict] | None = None

    @staticmethod
    def _put(txn, k: bytes, runtime: Runtime) -> bool:
        new = txn.get(k) is None
        txn.put(k, runtime.to_bytes())
        return new

    def put(self, obj) -> Runtime:
        runtime = Runtime.of(obj)
        k = _key_bytes(runtime.key)
        try:
            with self._lock, self.env.begin(write=True) as txn:
                if self._put(txn, k, runtime):
                    self._counts[runtime.kind] = self._counts.get(runtime.kind, 0) + 1
        except lmdb.MapFullError:
            raise StoreFull(f"the runtime store is full ({MAP_SIZE >> 20} MiB)") from None
        return runtime

    def delete(self, obj) -> None:
        k = key_of(obj)
        with self._lock, self.env.begin(write=True) as txn:
            if txn.delete(_key_bytes(k)):
                self._counts[k[0]] = max(0, self._counts.get(k[0], 0) - 1)

    def replace(self, kind: str, objs: Iterable) -> int:
        """A fresh list of one kind, in one transaction (readers see the old list or the new, whole), and the
        kind marked as listed; `objs` may be a generator reading pages: each is written as it comes. A list
        that fails midway (the API, or the store full) writes nothing: the last list stays."""
        prefix, fresh = _prefix(kind), set()
        try:
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
                if self.on_listed is not None:
                    txn.put(STATE, orjson.dumps(self.on_listed(kind, len(fresh))))
        except lmdb.MapFullError:
            raise StoreFull(f"the runtime store is full ({MAP_SIZE >> 20} MiB)") from None
        self._counts[kind] = len(fresh)
        return len(fresh)

    def count(self, kind: str) -> int:
        """The runtimes of `kind` held, as counted by the writes (no scan)."""
        return self._counts.get(kind, 0)

    def state(self) -> dict:
        """The keeper's state as last written (empty when none was)."""
        with self.env.begin() as txn:
            raw = txn.get(STATE)
        return orjson.loads(raw) if raw else {}

    def write_state(self, state: dict) -> None:
        with self._lock, self.env.begin(write=True) as txn:
            txn.put(STATE, orjson.dumps(state))

    def used_bytes(self) -> int:
        info, stat = self.env.info(), self.env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]

    def reader_check(self) -> int:
        """Free the reader slots of workers that died in a read (LMDB keeps them until asked)."""
        return self.env.reader_check()


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
        k = _key_bytes(key(kind, namespace, name))
        raw = self._get(k)
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
        env = self.env
        if env is None:
            return
        with env.begin() as txn:
            for k, v in txn.cursor():
                if not k.startswith(b"\0"):
                    yield k, v

    def __len__(self) -> int:
        return sum(1 for _ in self.items())

    def __iter__(self) -> Iterator[Runtime]:
        for _, v in self.items():
            yield Runtime.from_bytes(v)


def prepare(directory: str | None, fresh: bool = True) -> str:
    """The store's directory, made: `directory` (the pod's own volume) or a fresh private one (None: the caller
    removes it at exit). `fresh` empties an earlier store first (`serve` locally, whose keeper it starts); a
    keeper in a container of its own keeps the store it finds, which the workers answer from until it has
    listed again."""
    import tempfile

    if directory:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for name in ("data.mdb", "lock.mdb") if fresh else ():
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    else:
        directory = tempfile.mkdtemp(prefix="dispatch-admission-runtimes-")
    os.chmod(directory, 0o700)
    return directory
