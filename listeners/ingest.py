"""Group commit: every received message is staged in a short transaction shared with whatever else
arrived meanwhile, and its Deferred fires only after that transaction committed.

One writer thread drains the queue: while one transaction commits, newer messages queue up and go
into the next one, so batches grow with load and a lone message is never held back. A single
writer also keeps row ids in arrival order, which per-lane FIFO relies on. The reactor thread only
enqueues and fires Deferreds; no SQL ever runs on it.

One refused row fails alone (invariant 9, docs/invariants.md): when the store refuses a batch for
its data (`Dialect.is_refusal`: a value or a constraint), the batch is split in halves and each half
recommitted, left first (ids stay in arrival order), until every refused row stands alone; those
fail with `RowRefused`, the rest commit. k refused rows in n cost about 2k·log2(n) statements, never
more than 2n-1. A connection-level failure (database down) or a stale epoch is not split: it fails
the rest of the batch at once, as retrying pieces against a dead store only adds delay.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from twisted.application.service import Service
from twisted.internet import threads
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from include.store import Store
from include.store.rowlease import stage_inbound
from listeners.metrics import Metrics

_log = Logger(namespace="stageline.ingest")


class IngestRejected(Exception):
    """The message was not staged (no lease, stale epoch, store failure); never ACK it positively."""


class NotLeader(IngestRejected):
    pass


class StoreUnavailable(IngestRejected):
    pass


class RowRefused(IngestRejected):
    """The store refused this very row (its data), not the batch; ``str()`` is safe to send back."""


def new_message_id() -> str:
    """A random (version 4) UUID in hex, as ``uuid.uuid4().hex`` gives it, without building a
    `UUID` object per message."""
    n = int.from_bytes(os.urandom(16), "big")
    return "%032x" % (n & _V4_CLEAR | _V4_SET)


_V4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))  # the version nibble and the variant bits
_V4_SET = (4 << 76) | (0x8000 << 48)  # version 4, RFC 4122 variant


@dataclass(frozen=True, slots=True)
class Inbound:
    connection: str
    payload: str
    control_id: str | None = None
    lane_key: str | None = None
    charset: str | None = None
    message_id: str = field(default_factory=new_message_id)

    def row(self) -> dict[str, str | None]:
        """The row `stage_inbound` takes (what `dataclasses.asdict` gave, without its deep copy)."""
        return {"connection": self.connection, "payload": self.payload, "control_id": self.control_id,
                "lane_key": self.lane_key, "charset": self.charset, "message_id": self.message_id}


_STOP = object()


class IngestWriter:
    def __init__(self, store: Store, *, node_id: str, epoch: Callable[[], int | None], metrics: Metrics,
                 reactor, max_batch: int = 2000) -> None:
        self.store = store
        self.node_id = node_id
        self._epoch = epoch
        self.metrics = metrics
        self._reactor = reactor
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="stageline-ingest", daemon=True)
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: Inbound) -> Deferred:
        """Queue one message; the Deferred fires with its message_id after commit, or fails with
        an `IngestRejected` subclass."""
        d: Deferred = Deferred()
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put((item, d))
        return d

    def drain(self, timeout: float) -> bool:
        """Wait (off the reactor) until every submitted message has been committed or rejected."""
        return self._idle.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            stop = False
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            outcomes = self._commit([item for item, _ in batch])
            self._reactor.callFromThread(self._fire, batch, outcomes)
            if stop:
                return

    def _commit(self, items: list[Inbound]) -> list[IngestRejected | None]:
        """Stage `items`; one outcome per item: None = committed, else why not."""
        epoch = self._epoch()
        if epoch is None:
            return [NotLeader("this node does not hold the leader lease")] * len(items)
        started = time.perf_counter()
        outcomes: list[IngestRejected | None] = [None] * len(items)
        halt: IngestRejected | None = None  # once set, the rest of the batch fails with it
        statements, refused = 0, 0
        ranges = [(0, len(items))]  # a stack, left half on top: commits go in arrival order
        while ranges:
            lo, hi = ranges.pop()
            if halt is not None:
                outcomes[lo:hi] = [halt] * (hi - lo)
                continue
            statements += 1
            try:
                with self.store.single_statement() as tx:
                    staged = stage_inbound(tx, [i.row() for i in items[lo:hi]], epoch=epoch,
                                           node_id=self.node_id)
            except Exception as exc:
                if not self.store.dialect.is_refusal(exc):
                    self.metrics.store_errors.labels("stage_inbound").inc()
                    _log.warn("group commit of {n} message(s) failed: {err}", n=hi - lo, err=type(exc).__name__)
                    halt = StoreUnavailable(f"store unavailable: {type(exc).__name__}")
                    outcomes[lo:hi] = [halt] * (hi - lo)
                elif hi - lo == 1:
                    refused += 1
                    self.metrics.store_errors.labels("stage_inbound_refused").inc()
                    # Only the error class: the driver's text may quote the refused value (PHI).
                    outcomes[lo] = RowRefused(f"refused by the store ({type(exc).__name__}); not stored")
                    _log.warn("store refused message {control_id} on {connection}: {err}",
                              control_id=(items[lo].control_id or "-")[:64], connection=items[lo].connection,
                              err=type(exc).__name__)
                else:
                    mid = (lo + hi) // 2
                    ranges += [(mid, hi), (lo, mid)]
                continue
            if staged is None:
                halt = NotLeader(f"epoch {epoch} is no longer current")
                outcomes[lo:hi] = [halt] * (hi - lo)
        if refused:
            _log.info("group commit of {n} message(s): {refused} refused alone, {statements} statement(s)",
                      n=len(items), refused=refused, statements=statements)
        if any(outcome is None for outcome in outcomes):
            self.metrics.commit_seconds.observe(time.perf_counter() - started)
            self.metrics.commit_batch.observe(len(items))
        return outcomes

    def _fire(self, batch: list, outcomes: list[IngestRejected | None]) -> None:
        for (item, d), outcome in zip(batch, outcomes):
            if outcome is not None:
                d.errback(outcome)
            else:
                d.callback(item.message_id)  # a duplicate message_id was staged before: also durable
        with self._lock:
            self._pending -= len(batch)
            if self._pending == 0:
                self._idle.set()


class IngestService(Service):
    """The group-commit writer for the node's lifetime. It stops after the listeners (their last
    commits drained through `drain`) and before the lease is released."""

    def __init__(self, store: Callable[[], Store | None], *, node_id: str, epoch: Callable[[], int | None],
                 metrics: Metrics, reactor: Any) -> None:
        self.setName("ingest")
        self._store = store
        self._node_id = node_id
        self._epoch = epoch
        self._metrics = metrics
        self._reactor = reactor
        self.writer: IngestWriter | None = None

    def startService(self) -> None:
        store = self._store()
        assert store is not None, "the store service starts first"
        self.writer = IngestWriter(store, node_id=self._node_id, epoch=self._epoch, metrics=self._metrics,
                                   reactor=self._reactor)
        self.writer.start()
        super().startService()

    def submit(self, item: Inbound) -> Deferred:
        """`IngestWriter.submit`; only the leader's listeners call it, and only while this runs."""
        assert self.writer is not None
        return self.writer.submit(item)

    def drain(self, seconds: float) -> Deferred:
        """Fires True once every submitted message is committed or rejected, False at `seconds`."""
        if self.writer is None:
            return succeed(True)
        return threads.deferToThread(self.writer.drain, seconds)

    def stopService(self) -> Deferred:
        super().stopService()
        writer, self.writer = self.writer, None
        return threads.deferToThread(writer.stop) if writer is not None else succeed(None)
