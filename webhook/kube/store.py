"""The runtime cache of a pod, in one place for all its workers: an LMDB environment in a directory.

One process per pod writes it: the runtime keeper (`webhook.kube.keeper`, `dispatch-admission keep`), in a
container of its own in the cluster (a native sidecar sharing the store's volume) or a process `serve`
starts locally. Every gunicorn worker of the serving container maps the same file read-only. The cache is
held once per pod, and a worker reads a runtime in a few microseconds without a call to another process
(LMDB readers take no lock and copy nothing but the value; webhook.kube.store_reader).

The store outlives the keeper: a keeper that restarts (an OOM kill, a node's pressure) leaves the last
synced store to the workers, which go on answering from it and say how old it is; the new keeper lists
again into it. LMDB's copy-on-write keeps it whole whatever point the writer dies at.

A list is written in generations (issue 47): each kind's runtimes are keyed `kind \x1f generation \x1f namespace
\x1f name`, and `GENERATION + kind` says which generation the readers read. A relist writes a new generation in
transactions of at most BATCH_BYTES each (so the keeper holds one batch, not the list: LMDB keeps a write
transaction's dirty pages in the heap until its commit), then switches the pointer in one transaction and drops
the old generation in batches. A reader reads the pointer and the runtime in one transaction: it sees the old
list or the new one, whole, never half of one. Values are `Runtime.to_bytes()`. Keys starting with NUL are the
store's own: the generations, which kinds have completed a first list, and the keeper's state (`STATE`: when each
kind was last confirmed, how often the keeper started, its requests and errors), which the serving container
exports.

Two bounds keep one tenant from filling it for the others: a namespace's TrainingRuntimes are held in full up to
its share (`namespace_share` bytes, `keep --namespace-share`; webhook.kube.store_shares counts them); past it a
runtime is held as its name and the reason (R5 refuses a TrainJob naming it, giving the namespace's size and the
share). A store that is full keeps what it holds: a list that does not fit is switched to as far as it was
written (what it lacks is confirmed by a live read, as any miss), and a watch event that does not fit removes the
runtime's older version; both are logged and counted (`not_held`), never the whole list discarded.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable

import lmdb
import orjson

from ..core.runtimes import KINDS, MAX_STORED_BYTES, NAMESPACE_SHARE, Key, Runtime, key_of
from .store_shares import Share, Written, over_share

log = logging.getLogger(__name__)

# The store's hard ceiling: LMDB never grows its file past it (a write past it fails, and is counted). One runtime
# is stored in at most MAX_STORED_BYTES and a little (a larger one is held as too large to check, in a few hundred
# bytes), and 10,000 ordinary runtimes take about 8 MiB: 512 MiB is thousands of runtimes at the bound. The chart's
# ephemeral-storage limit and the volume's sizeLimit are above it, so no tenant can get the pod evicted through it.
MAP_SIZE = 512 << 20
SYNCED = b"\0synced\x1f"
STATE = b"\0state"
GENERATION = b"\0generation\x1f"  # + kind: the generation of that kind the readers read
FORMAT = b"\0format"
FORMAT_VERSION = b"2"  # 2: keys carry a generation (a store of another format is emptied and listed again)
BATCH_BYTES = 4 << 20  # what one write transaction of a list holds at most: the keeper's heap for a relist
DROP_BATCH = 1000  # keys of an old generation deleted per transaction
assert MAX_STORED_BYTES < BATCH_BYTES


def stored_key(k: Key, generation: bytes) -> bytes:
    return b"\x1f".join((k[0].encode(), generation, k[1].encode(), k[2].encode()))


def kind_prefix(kind: str) -> bytes:
    return kind.encode() + b"\x1f"


class StoreFull(Exception):
    """The store reached MAP_SIZE and not even a runtime's older version could be removed to say so."""


class StoreWriter:
    """The keeper's side: the only writer. It takes the calls a Reflector makes of an index, and keeps a count
    per kind as it writes, so a watch event costs the same whatever the number of runtimes."""

    def __init__(self, directory: str, map_size: int = MAP_SIZE, namespace_share: int = NAMESPACE_SHARE,
                 batch_bytes: int = BATCH_BYTES):
        self.env = lmdb.open(directory, map_size=map_size, subdir=True, sync=False, metasync=False,
                             max_readers=512)
        self.batch_bytes = batch_bytes
        self._lock = threading.Lock()  # one write transaction at a time from this process's threads
        self._counts: dict[str, int] = {}
        self._shares = {kind: Share(namespace_share) for kind in KINDS}
        # Runtimes not held whole, per (kind, why): "store-full" (not at all) or "namespace-share" (as the reason
        # only), counted at each list and as watch events add to them; the keeper exports them.
        self.not_held = {(kind, why): 0 for kind in KINDS for why in ("store-full", "namespace-share")}  # fixed keys
        # Called in a list's transaction with (kind, runtimes listed): the keeper's state to write with it, so a
        # worker that sees the kind listed sees the state that says so (webhook.kube.keeper).
        self.on_listed: Callable[[str, int], dict] | None = None
        self.on_full: Callable[[str], None] | None = None  # a write the store had no room for (the keeper counts it)
        self._generations = self._open()

    def _open(self) -> dict[str, bytes]:
        """The generation each kind is read at; a store of another format is emptied first (the keeper lists)."""
        with self.env.begin(write=True) as txn:
            if txn.get(FORMAT) != FORMAT_VERSION:
                txn.drop(self.env.open_db(txn=txn), delete=False)
                txn.put(FORMAT, FORMAT_VERSION)
            generations = {}
            for kind in KINDS:  # generation 0 (empty) for a kind never listed
                generations[kind] = txn.get(GENERATION + kind.encode()) or b"0"
                txn.put(GENERATION + kind.encode(), generations[kind])
            return generations

    def put(self, obj) -> Runtime:
        runtime = Runtime.of(obj)
        kind, share = runtime.kind, self._shares[runtime.kind]
        held = dict(share.held)
        try:
            with self._lock, self.env.begin(write=True) as txn:
                k = stored_key(runtime.key, self._generations[kind])
                old = txn.get(k)
                value = share.value(runtime, k, 0 if old is None else len(k) + len(old))
                txn.put(k, value)
        except lmdb.MapFullError:
            share.held = held
            self._full_put(runtime.key)
            return runtime
        if old is None:
            self._counts[kind] = self._counts.get(kind, 0) + 1
        self._count_share(kind, (old is not None and over_share(old), over_share(value)))
        return runtime

    def _count_share(self, kind: str, was_is: tuple[bool, bool]) -> None:
        change = int(was_is[1]) - int(was_is[0])
        if change:
            why = (kind, "namespace-share")
            self.not_held[why] = max(0, self.not_held.get(why, 0) + change)

    def _full_put(self, k: Key) -> None:
        """No room for a watch event's runtime: its older version goes (a miss is confirmed by a live read; an
        old version would be checked in its place), and it is said."""
        if self.on_full is not None:
            self.on_full(k[0])
        why = (k[0], "store-full")
        self.not_held[why] = self.not_held.get(why, 0) + 1
        log.warning('{"msg": "runtime store full: runtime not held", "kind": "%s", "namespace": "%s", "name": "%s"}',
                    *k)
        self._delete(k)

    def delete(self, obj) -> None:
        self._delete(key_of(obj))

    def _delete(self, k: Key) -> None:
        try:
            with self._lock, self.env.begin(write=True) as txn:
                sk = stored_key(k, self._generations[k[0]])
                old = txn.get(sk)
                if old is not None:
                    txn.delete(sk)
        except lmdb.MapFullError:
            raise StoreFull(f"the runtime store is full ({MAP_SIZE >> 20} MiB)") from None
        if old is not None:
            self._counts[k[0]] = max(0, self._counts.get(k[0], 0) - 1)
            self._shares[k[0]].release(k[0], k[1], len(sk) + len(old))
            self._count_share(k[0], (over_share(old), False))

    def replace(self, kind: str, objs: Iterable) -> int:
        """A fresh list of one kind into a new generation, in batches as `objs` comes (a generator reading
        pages), switched to whole at its end (see the module doc); the old generation is then dropped. A list
        that fails midway (the API) leaves the last list read; a store that fills switches to what it wrote."""
        old = self._generations[kind]
        self._drop_generations(kind, keep=old)  # a keeper that died midway left its list's start
        new = b"%d" % (int(old) + 1)
        share, written = Share(self._shares[kind].limit), Written(kind, new)
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        for runtime in (Runtime.of(o, kind) for o in objs):
            k = stored_key(runtime.key, new)
            batch.append((k, share.value(runtime, k)))
            size += len(k) + len(batch[-1][1])
            if size >= self.batch_bytes:
                self._write_batch(written, batch)
                batch, size = [], 0
        self._write_batch(written, batch)
        if not written.switched:
            self._switch(written)
        self._listed(written, share)
        return written.held

    def _write_batch(self, written: Written, batch: list[tuple[bytes, bytes]]) -> None:
        """One transaction of a list; when the store is full, the list is switched to as written so far (the
        old one dropped, which makes room) and the batch written again one runtime at a time."""
        try:
            with self._lock, self.env.begin(write=True) as txn:
                for k, v in batch:
                    txn.put(k, v)
            written.took(batch)
            return
        except lmdb.MapFullError:
            pass
        if not written.switched:
            self._switch(written)
        for k, v in batch:
            try:
                with self._lock, self.env.begin(write=True) as txn:
                    txn.put(k, v)
                written.took([(k, v)])
            except lmdb.MapFullError:
                written.not_held += 1

    def _switch(self, written: Written) -> None:
        """The readers read the new generation from this transaction on; then the old one is dropped."""
        kind = written.kind
        try:
            with self._lock, self.env.begin(write=True) as txn:
                txn.put(GENERATION + kind.encode(), written.generation)
                txn.put(SYNCED + kind.encode(), b"1")
                if self.on_listed is not None:
                    txn.put(STATE, orjson.dumps(self.on_listed(kind, written.held)))
        except lmdb.MapFullError:  # the list's generation is dropped at the next list's start
            raise StoreFull(f"the runtime store is full ({MAP_SIZE >> 20} MiB)") from None
        self._generations[kind] = written.generation
        written.switched = True
        self._drop_generations(kind, keep=written.generation)

    def _listed(self, written: Written, share: Share) -> None:
        kind = written.kind
        self._counts[kind] = written.held
        share.held = {ns: n for ns, n in written.namespaces.items() if n}
        self._shares[kind] = share
        self.not_held[(kind, "store-full")] = written.not_held
        self.not_held[(kind, "namespace-share")] = written.over_share
        if written.not_held:
            if self.on_full is not None:
                self.on_full(kind)
            log.warning('{"msg": "runtime store full: list held in part", "kind": "%s", "held": %d, "not_held": %d}',
                        kind, written.held, written.not_held)
        for ns, n in sorted(written.over_namespaces.items()):
            log.warning('{"msg": "namespace past its share of the runtime store", "kind": "%s", "namespace": "%s",'
                        ' "held_bytes": %d, "share_bytes": %d, "runtimes_held_as_over_share": %d}',
                        kind, ns, share.held.get(ns, 0), share.limit, n)

    def _drop_generations(self, kind: str, keep: bytes | None) -> None:
        """Delete every key of `kind` outside generation `keep`, DROP_BATCH a transaction."""
        prefix = kind_prefix(kind)
        kept = None if keep is None else prefix + keep + b"\x1f"
        while True:
            with self._lock, self.env.begin(write=True) as txn:
                cursor, dropped = txn.cursor(), 0
                found = cursor.set_range(prefix)
                while found and dropped < DROP_BATCH:
                    k = cursor.key()
                    if not k.startswith(prefix):
                        return
                    if kept is not None and k.startswith(kept):
                        found = cursor.set_range(kept[:-1] + b"\x20")  # past the kept generation's keys
                        continue
                    found = cursor.delete()
                    dropped += 1
                if dropped < DROP_BATCH:
                    return

    def count(self, kind: str) -> int:
        """The runtimes of `kind` held, as counted by the writes (no scan)."""
        return self._counts.get(kind, 0)

    def namespace_bytes(self, kind: str, namespace: str) -> int:
        """What a namespace's runtimes of `kind` take in the store (their keys and values), as counted by the writes."""
        return self._shares[kind].held.get(namespace, 0)

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
