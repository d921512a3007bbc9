"""The runtime keeper: the pod's one list and watch of the runtimes, written into the store the workers read,
and the pod's live reads on a miss (`dispatch-admission keep`).

In the cluster it runs as a container of its own in the webhook's pod (a native sidecar: an init container
with `restartPolicy: Always`, sharing the store's volume), with its own memory limit: Kubernetes supervises
it, backs its restarts off, and its OOM kill never touches the serving container, which goes on answering
from the last synced store and says how old it is. Locally, `serve` starts one as a plain child process.

Each second it writes its state into the store (webhook.kube.store.STATE): when each kind was last listed and
last confirmed current, the runtimes held, how often a keeper started on this store, its requests, errors
and live reads. The serving container exports it (webhook.process.metrics).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from ..core.runtimes import KINDS
from ..process.stopping import stopped_by_signals
from . import live_reads
from .client import api_client
from .reflector import ReadStats, Reflector
from .runtime_api import RuntimeAPI
from .store import NAMESPACE_SHARE, StoreFull, StoreWriter, prepare

log = logging.getLogger(__name__)

STATE_SECONDS = 1.0  # how often the state is written


class Keeper:
    """The pod's one list-and-watch per kind, writing into the store."""

    def __init__(self, api: RuntimeAPI, store: StoreWriter, stats: ReadStats, start: bool = True):
        self.store = store
        # api.list gives a Listing, which Reflector takes in place of (items, version)
        self.reflectors = {k: Reflector(k, store, api.list, api.watch, stats=stats)  # type: ignore[arg-type]
                           for k in KINDS}
        if start:
            for r in self.reflectors.values():
                threading.Thread(target=r.run, name=f"watch-{r.kind}", daemon=True).start()

    def stop(self) -> None:
        for r in self.reflectors.values():
            r.stopped.set()


def run(directory: str, kubeconfig: str | None = None, rate: float = live_reads.DEFAULT_RATE,
        burst: int = live_reads.DEFAULT_BURST, fresh: bool = False, parent: int | None = None,
        namespace_share: int = NAMESPACE_SHARE) -> int:
    """Keep the store in `directory` until SIGTERM (or, with `parent`, until that process is gone)."""
    stopped = stopped_by_signals()
    if parent is not None:
        _die_with_parent(parent)
    writer = StoreWriter(prepare(directory, fresh=fresh), namespace_share=namespace_share)
    before = writer.state()
    stats = ReadStats()
    stats.resume(before)
    starts = int(before.get("starts", 0)) + 1
    started = time.time()

    def listed(kind: str, count: int) -> dict:
        stats.listed(kind, count)
        return state_of(writer, stats, starts, started)

    writer.on_listed = listed
    writer.on_full = lambda kind: stats.error("store", kind)  # a write the store had no room for
    write_state(writer, stats, starts, started)
    api = RuntimeAPI(api_client(kubeconfig), stats)
    answers = live_reads.Answers(api.get, rate=rate, burst=burst, count=stats.live_read)
    server = live_reads.Server(directory, answers)
    threading.Thread(target=server.serve_forever, name="live-reads", daemon=True).start()
    keeper = Keeper(api, writer, stats)
    log.info('{"msg": "runtime keeper started", "pid": %d, "starts": %d, "store": "%s"}', os.getpid(), starts,
             directory)
    while not stopped.wait(STATE_SECONDS):
        if parent is not None and os.getppid() != parent:
            break
        write_state(writer, stats, starts, started)
        writer.reader_check()
    keeper.stop()
    server.shutdown()
    write_state(writer, stats, starts, started)
    return 0


def state_of(writer: StoreWriter, stats: ReadStats, starts: int, started: float) -> dict:
    state = stats.snapshot()
    state.update(starts=starts, started=started, written=time.time(), store_bytes=writer.used_bytes(),
                 not_held={f"{kind}\x1f{why}": n for (kind, why), n in dict(writer.not_held).items()})
    return state


def write_state(writer: StoreWriter, stats: ReadStats, starts: int, started: float) -> None:
    try:
        writer.write_state(state_of(writer, stats, starts, started))
    except StoreFull:
        stats.error("store", "state")


def _die_with_parent(parent: int) -> None:
    """SIGTERM when the process that started it dies, however it dies (prctl PR_SET_PDEATHSIG): a keeper started
    by a local `serve` never outlives it."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)
