"""Group commit: every received message is staged in a short transaction shared with whatever else
arrived meanwhile, and its Deferred fires only after that transaction committed.

One writer drains the queue: while one transaction commits, newer messages queue up and go into
the next one, so batches grow with load and a lone message is never held back. A commit is capped
by rows, not units (`MAX_ROWS_PER_COMMIT`): an HL7 batch counts its messages, and one larger than
the cap is committed in parts with other senders' messages between them (`listeners.commitplan`);
one larger than `MAX_BATCH_MESSAGES` is refused whole (AR). A single writer
(one statement in flight at a time) also keeps row ids in arrival order, which per-lane FIFO
relies on. `IngestWriter` is a thread of its own, for every store; the reactor only enqueues and
fires Deferreds. On PostgreSQL, whose staging statement is self-contained and autocommitted,
`ReactorIngestWriter` sends it without blocking from the reactor itself (`listeners.pgcommit`):
nothing waits on a thread hand-over either way. Neither ever blocks the reactor on the database.

One refused row fails alone (invariant 9, docs/invariants.md): when the store refuses a batch for
its data (`Dialect.is_refusal`: a value or a constraint), the batch is split in halves and each half
recommitted, left first (ids stay in arrival order), until every refused row stands alone; those
fail with `RowRefused`, the rest commit. An HL7 batch (`InboundBatch`), or one part of a large
one, is one unit of the split: its messages commit together, or it fails whole. k refused rows in n
cost about 2k·log2(n) statements, never more than 2n-1. A connection-level failure (database down)
or a stale epoch is not split: it fails the rest of the batch at once, as retrying pieces against a
dead store only adds delay.

A message answered without an outcome (the handler's timeout cancelled its Deferred) or with a
failure after which it may have landed is remembered (`listeners.resend`): its re-send gets the
same message ids, so it is never staged twice and is answered AA.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Required, TypedDict, Unpack

from twisted.application.service import Service
from twisted.internet import threads
from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from include.config import StoreConfig
from include.store import Store
from include.store.rowlease import stage_inbound
from listeners.commitplan import BatchPart, CommitPlan, Entry
from listeners.metrics import Metrics
from listeners.pgcommit import PgStager
from listeners.resend import ResendMemory

_log = Logger(namespace="stageline.ingest")


LOCKED_RETRY_SECONDS = StoreConfig.busy_retry_seconds
"""The default of `[store].busy_retry_seconds`: how long after its oldest message arrived a group
commit may still be trying while SQLite's write lock is busy: a new try starts only if it would
end by then (a try waits up to `[store].busy_timeout_ms`), so every answer — `AA` once the turn
comes — goes out well inside the MLLP handler's 60 s timeout, never an `AE` for a message that is
committed after it."""


class IngestRejected(Exception):
    """The message was not staged (no lease, stale epoch, store failure); never ACK it positively."""


class NotLeader(IngestRejected):
    pass


class StoreUnavailable(IngestRejected):
    pass


class RowRefused(IngestRejected):
    """The store refused this very row (its data), not the batch; ``str()`` is safe to send back."""


class BatchTooLarge(RowRefused):
    """An HL7 batch of more than `max_batch_messages` messages: refused whole (AR), nothing staged."""


class BatchIncomplete(IngestRejected):
    """A batch committed in parts (`listeners.commitplan`) whose later part failed: its first
    `stored` messages are committed (and stay: they are durable, and will be routed), the rest are
    not. ``str()`` says so and is safe to send back; a re-send of the same batch is recognised
    (`listeners.resend`) and stages only the messages that are missing."""

    def __init__(self, *, stored: int, total: int, why: BaseException) -> None:
        super().__init__(
            f"batch partly stored: messages 1-{stored} of {total} stored, {stored + 1}-{total} "
            f"not ({type(why).__name__}); resend the batch: what is stored is not stored twice"
        )
        self.stored, self.total, self.why = stored, total, why


def new_message_id() -> str:
    """A time-ordered (version 7, RFC 9562) UUID in hex: the Unix time in milliseconds, then 74
    random bits. Every index keyed on message ids (the inbound row's, the audit events', the
    outbound idempotency key) then takes new entries at its right-hand edge, as it takes new row
    ids, not scattered over pages that each cost a write and, after a checkpoint, a full-page
    image in the WAL. Built from the bytes, not a `UUID` object per message."""
    n = int.from_bytes(os.urandom(10), "big") & _V7_RANDOM
    return "%032x" % ((time.time_ns() // 1_000_000) << 80 | _V7_VERSION | n)


_V7_RANDOM = ((1 << 80) - 1) & ~((0xF << 76) | (0x3 << 62))  # the version nibble and variant bits clear
_V7_VERSION = (7 << 76) | (0x2 << 62)  # version 7, RFC 9562 variant


@dataclass(frozen=True, slots=True)
class Inbound:
    connection: str
    payload: str
    control_id: str | None = None
    lane_key: str | None = None
    charset: str | None = None
    message_id: str = field(default_factory=new_message_id)
    findings: str | None = None  # a flagging profile's findings, JSON (listeners/profile_check.py)
    format: str | None = None  # "fhir": a body the FHIR inbound validated; None: HL7 v2 or other text

    def row(self) -> dict[str, str | None]:
        """The row `stage_inbound` takes (what `dataclasses.asdict` gave, without its deep copy)."""
        return {
            "connection": self.connection,
            "payload": self.payload,
            "control_id": self.control_id,
            "lane_key": self.lane_key,
            "charset": self.charset,
            "message_id": self.message_id,
            "findings": self.findings,
            "format": self.format,
        }


@dataclass(frozen=True, slots=True)
class InboundBatch:
    """An HL7 batch split into its messages: staged together with its record (`inbound_batches`),
    in one statement, or not at all. A group commit treats it as one unit: a refusal fails it
    whole. Its Deferred fires with the batch_id."""

    connection: str
    batch_id: str
    items: tuple[Inbound, ...]
    fhs_control_id: str | None = None
    bhs_control_id: str | None = None
    declared: int | None = None  # what the trailers (BTS-1) said, when they said it
    envelope: Any = field(default=None, compare=False, repr=False)  # the `BatchHeader`, to answer it

    @property
    def message_id(self) -> str:
        return self.batch_id

    @property
    def control_id(self) -> str | None:
        return self.bhs_control_id or self.fhs_control_id

    def rows(self, lo: int = 0, hi: int | None = None) -> list[dict[str, Any]]:
        """One `stage_inbound` row per message (of messages ``lo`` to ``hi``, from 0); the first
        message's row carries the batch's record."""
        n = len(self.items)
        out: list[dict[str, Any]] = []
        for seq, item in enumerate(self.items[lo:hi], lo + 1):
            row: dict[str, Any] = {**item.row(), "batch_id": self.batch_id, "batch_seq": seq, "batch_size": n}
            if seq == 1:
                row.update(batch_fhs=self.fhs_control_id, batch_bhs=self.bhs_control_id, batch_declared=self.declared)
            out.append(row)
        return out


Unit = Inbound | InboundBatch
"""What one `submit` hands over."""

Piece = Inbound | InboundBatch | BatchPart
"""What a group commit's split on refusal never cuts: a message, a batch, or a part of a large one
(`listeners.commitplan`)."""


def _rows(units: list[Piece]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for unit in units:
        if unit.__class__ is not Inbound:
            rows.extend(unit.rows())  # type: ignore[union-attr]
        else:
            rows.append(unit.row())
    return rows


_STOP = object()

MAX_ROWS_PER_COMMIT = 2000
"""Rows (messages) per group commit: a batch of more is committed in parts (`listeners.commitplan`)."""

MAX_BATCH_MESSAGES = 50_000
"""A larger HL7 batch is refused whole with AR (`BatchTooLarge`): what no sender needs, and what would
hold its lanes for longer than a few seconds."""


def _count(piece: Piece) -> int:
    """Rows (messages) a piece writes."""
    if piece.__class__ is Inbound:
        return 1
    if piece.__class__ is BatchPart:
        return piece.hi - piece.lo
    return len(piece.items)  # type: ignore[union-attr]  # an InboundBatch: the other two are out above


Outcome = IngestRejected | None  # per message: None = committed, else why not
Steps = Generator[list[Piece], "Staged | BaseException | None", list[Outcome]]
"""A group commit's statements (`_GroupCommit.statements`): sent each one's result, returns the outcomes."""
Staged = dict[str, int] | None  # what one staging statement gave: rows written, or None = stale epoch


class _GroupCommit:
    """What both writers share: the batch's split on refusal (the module docstring), its outcomes,
    metrics and log lines. `statements()` yields each slice of items to stage in turn and is sent
    back what that statement gave (`Staged`) or the exception it raised."""

    def __init__(self, items: list[Piece], *, epoch: int, dialect: Any, metrics: Metrics) -> None:
        self.items = items
        self.epoch = epoch
        self._dialect = dialect
        self._metrics = metrics
        self.outcomes: list[Outcome] = [None] * len(items)

    def statements(self) -> Generator[list[Piece], Staged | BaseException, list[Outcome]]:
        items, outcomes = self.items, self.outcomes
        started = time.perf_counter()
        halt: IngestRejected | None = None  # once set, the rest of the batch fails with it
        statements, refused = 0, 0
        ranges = [(0, len(items))]  # a stack, left half on top: commits go in arrival order
        while ranges:
            lo, hi = ranges.pop()
            if halt is not None:
                outcomes[lo:hi] = [halt] * (hi - lo)
                continue
            statements += 1
            staged = yield items[lo:hi]
            if isinstance(staged, BaseException):
                exc = staged
                if not self._dialect.is_refusal(exc):
                    self._metrics.store_errors.labels("stage_inbound").inc()
                    _log.warn("group commit of {n} message(s) failed: {err}", n=hi - lo, err=type(exc).__name__)
                    halt = StoreUnavailable(f"store unavailable: {type(exc).__name__}")
                    outcomes[lo:hi] = [halt] * (hi - lo)
                elif hi - lo == 1:
                    refused += 1
                    self._metrics.store_errors.labels("stage_inbound_refused").inc()
                    # Only the error class: the driver's text may quote the refused value (PHI).
                    what = "batch refused" if items[lo].__class__ is not Inbound else "refused"
                    outcomes[lo] = RowRefused(f"{what} by the store ({type(exc).__name__}); not stored")
                    _log.warn(
                        "store refused message {control_id} on {connection}: {err}",
                        control_id=(items[lo].control_id or "-")[:64],
                        connection=items[lo].connection,
                        err=type(exc).__name__,
                    )
                else:
                    mid = (lo + hi) // 2
                    ranges += [(mid, hi), (lo, mid)]
                continue
            if staged is None:
                halt = NotLeader(f"epoch {self.epoch} is no longer current")
                outcomes[lo:hi] = [halt] * (hi - lo)
        if refused:
            _log.info(
                "group commit of {n} message(s): {refused} refused alone, {statements} statement(s)",
                n=len(items),
                refused=refused,
                statements=statements,
            )
        if None in outcomes:  # something committed
            self._metrics.commit_seconds.observe(time.perf_counter() - started)
            self._metrics.commit_batch.observe(sum(_count(i) for i in items))
        return outcomes


class IntakeSettings(TypedDict, total=False):
    """The keyword arguments both writers take (each adds its own): who writes, under which epoch,
    counted where, on which reactor; the group commit's bounds; the re-sends it remembers."""

    node_id: Required[str]
    epoch: Required[Callable[[], int | None]]
    metrics: Required[Metrics]
    reactor: Required[Any]
    max_batch: int
    """Rows per commit at most (default `MAX_ROWS_PER_COMMIT`)."""
    max_batch_messages: int
    """Messages an HL7 batch may hold (default `MAX_BATCH_MESSAGES`); a larger one is refused whole."""
    resends: ResendMemory | None


class _Intake:
    """What both writers share: their settings, and on the reactor `submit` (refuse a batch over
    `max_batch_messages`, recognise a re-send (`listeners.resend`), hand an `Entry` to the writer's
    own `_enqueue`) and answering what a commit finished."""

    def __init__(self, store: Store, **settings: Unpack[IntakeSettings]) -> None:
        self.store = store
        self.node_id = settings["node_id"]
        self._epoch = settings["epoch"]
        self.metrics = settings["metrics"]
        self._reactor = settings["reactor"]
        self.max_batch = settings.get("max_batch", MAX_ROWS_PER_COMMIT)
        self.max_batch_messages = settings.get("max_batch_messages", MAX_BATCH_MESSAGES)
        resends = settings.get("resends")
        self.resends = resends if resends is not None else ResendMemory()

    def submit(self, item: Unit) -> Deferred[str]:
        """Queue one message (or batch); the Deferred fires with its message_id (batch_id) after
        commit, or fails with an `IngestRejected` subclass."""
        if item.__class__ is InboundBatch and len(item.items) > self.max_batch_messages:
            n = len(item.items)
            _log.warn(
                "refusing a batch of {n} messages on {connection}: more than max_batch_messages ({limit})",
                n=n,
                connection=item.connection,
                limit=self.max_batch_messages,
            )
            return fail(
                BatchTooLarge(
                    f"batch of {n} messages refused: at most {self.max_batch_messages} "
                    "messages per batch; send it as smaller batches"
                )
            )
        item = self.resends.recall(item)
        # Cancelled = answered without an outcome (the handler's timeout): a re-send is recognised.
        d: Deferred[str] = Deferred(canceller=lambda _: self.resends.remember(item))
        self._enqueue(Entry.of(item, d, time.monotonic(), max_rows=self.max_batch))
        return d

    def _enqueue(self, entry: Entry) -> None:
        raise NotImplementedError

    def _answer(self, finished: list[tuple[Entry, Outcome]]) -> None:
        for entry, outcome in finished:
            item, d = entry.unit, entry.d
            if outcome is not None and entry.split and entry.done:
                outcome = BatchIncomplete(stored=entry.done, total=entry.rows, why=outcome)
            if outcome is not None and not isinstance(outcome, (RowRefused, NotLeader)):
                self.resends.remember(item)  # it may have landed (a broken connection), or partly
            if d.called:
                continue  # cancelled: answered already (and remembered)
            if outcome is not None:
                d.errback(outcome)
            else:
                d.callback(item.message_id)  # a duplicate message_id was staged before: also durable


class IngestWriter(_Intake):
    """The group commit in a writer thread, for every store (each statement blocks that thread)."""

    def __init__(
        self, store: Store, *, locked_retry_seconds: float = LOCKED_RETRY_SECONDS, **settings: Unpack[IntakeSettings]
    ) -> None:
        super().__init__(store, **settings)
        self.locked_retry_seconds = locked_retry_seconds
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # entries, then _STOP
        self._thread = threading.Thread(target=self._run, name="stageline-ingest", daemon=True)
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    def start(self) -> None:
        self._thread.start()

    def _enqueue(self, entry: Entry) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put(entry)

    def drain(self, timeout: float) -> bool:
        """Wait (off the reactor) until every submitted message has been committed or rejected."""
        return self._idle.wait(timeout)

    def when_idle(self, seconds: float) -> Deferred[bool]:
        """`drain` as a Deferred (for the reactor): True once idle, False at `seconds`."""
        return threads.deferToThread(self.drain, seconds)

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def shutdown(self) -> Deferred[None]:
        """`stop` as a Deferred (for the reactor)."""
        return threads.deferToThread(self.stop)

    def _run(self) -> None:
        plan = CommitPlan(self.max_batch)
        stop = False
        while True:
            if not plan:
                if stop:
                    return
                first = self._queue.get()
                if first is _STOP:
                    return
                plan.add(first)
            while not stop:  # everything that arrived meanwhile: the plan picks the next commit
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                else:
                    plan.add(nxt)
            taken = plan.take()
            outcomes = self._commit([piece for _, piece in taken], since=min(e.since for e, _ in taken))
            finished = plan.settle(taken, outcomes, now=time.monotonic())
            if finished:
                self._reactor.callFromThread(self._fire, finished)

    def _commit(self, items: list[Piece], *, since: float | None = None) -> list[Outcome]:
        """Stage `items` (the oldest arrived at `since`, monotonic; default now); one outcome per
        item: None = committed, else why not."""
        deadline = (time.monotonic() if since is None else since) + self.locked_retry_seconds
        epoch = self._epoch()
        if epoch is None:
            return [NotLeader("this node does not hold the leader lease")] * len(items)
        steps = _GroupCommit(items, epoch=epoch, dialect=self.store.dialect, metrics=self.metrics).statements()
        try:
            chunk = next(steps)
            while True:
                chunk = steps.send(self._stage_chunk(chunk, epoch, deadline))
        except StopIteration as done:
            outcomes: list[Outcome] = done.value
            return outcomes

    def _stage_chunk(self, chunk: list[Piece], epoch: int, deadline: float) -> Staged | BaseException:
        """One staging statement; a busy store (SQLite's write lock held past its busy timeout) is
        tried again while another try would still end by `deadline` (LOCKED_RETRY_SECONDS after
        the batch's oldest message arrived), so a commit that waited behind stage work gets its
        turn — and its `AA` — instead of an `AE` (issue 22), and no answer outlives the handler."""
        busy = self.store.config.busy_timeout_ms / 1000
        while True:
            try:
                with self.store.single_statement() as tx:
                    return stage_inbound(tx, _rows(chunk), epoch=epoch, node_id=self.node_id)
            except Exception as exc:
                if not self.store.dialect.is_conflict(exc) or time.monotonic() + busy > deadline:
                    return exc
                self.metrics.store_busy.inc()
                _log.warn("store busy ({err}); the group commit of {n} unit(s) tries again", err=str(exc), n=len(chunk))

    def _fire(self, finished: list[tuple[Entry, Outcome]]) -> None:
        self._answer(finished)
        with self._lock:
            self._pending -= len(finished)
            if self._pending == 0:
                self._idle.set()


class ReactorIngestWriter(_Intake):
    """The group commit on the reactor thread, for PostgreSQL (`listeners.pgcommit`): no writer
    thread, no hand-over either way. Same commits (`listeners.commitplan`), same split on refusal,
    same outcomes.

    A commit starts at the end of the reactor turn in which its first message arrived (messages
    that arrived in the same turn, e.g. from other connections, join it) and the next one as soon
    as the previous committed: a lone message waits for nothing.
    """

    def __init__(self, store: Store, *, stager: PgStager | None = None, **settings: Unpack[IntakeSettings]) -> None:
        super().__init__(store, **settings)
        self._stager = stager if stager is not None else PgStager(store, self._reactor)
        self._plan = CommitPlan(self.max_batch)
        self._busy = False  # a commit is in flight (or is about to start)
        self._idle_waiters: list[Deferred[bool]] = []
        self._stopped = False

    def start(self) -> None:
        self._stager.open()

    def _enqueue(self, entry: Entry) -> None:
        self._plan.add(entry)
        if not self._busy:
            self._busy = True
            self._reactor.callLater(0, self._next_batch)

    @property
    def idle(self) -> bool:
        return not self._busy and not self._plan

    def when_idle(self, seconds: float) -> Deferred[bool]:
        """True once every submitted message is committed or rejected, False at `seconds`."""
        if self.idle:
            return succeed(True)
        d: Deferred[bool] = Deferred()
        self._idle_waiters.append(d)
        timer = self._reactor.callLater(seconds, self._give_up, d)
        d.addBoth(lambda r: (timer.cancel() if timer.active() else None, r)[1])
        return d

    def _give_up(self, d: Deferred[bool]) -> None:
        if d in self._idle_waiters:
            self._idle_waiters.remove(d)
            d.callback(False)

    def shutdown(self) -> Deferred[None]:
        """Stop after the commit in flight (the node drained the listeners before)."""

        def close(_: object) -> None:
            self._stopped = True
            self._stager.close()

        return self.when_idle(10.0).addCallback(close)

    def _next_batch(self) -> None:
        """Start the next commit; with nothing waiting, the writer is idle."""
        while self._plan:
            if self._start(self._plan.take()):
                return
        self._busy = False
        waiters, self._idle_waiters = self._idle_waiters, []
        for d in waiters:
            d.callback(True)

    def _start(self, taken: list[tuple[Entry, Piece]]) -> bool:
        """Send the commit's first statement (True), or fail it at once when there is no lease."""
        epoch = self._epoch()
        if epoch is None or self._stopped:
            why = (
                NotLeader("this node does not hold the leader lease")
                if epoch is None
                else StoreUnavailable("the ingest writer has stopped")
            )
            self._answer(self._plan.settle(taken, [why] * len(taken), now=time.monotonic()))
            return False
        steps = _GroupCommit(
            [piece for _, piece in taken], epoch=epoch, dialect=self.store.dialect, metrics=self.metrics
        ).statements()
        self._stage(taken, steps, epoch, next(steps))
        return True

    def _stage(self, taken: list[tuple[Entry, Piece]], steps: Steps, epoch: int, chunk: list[Piece]) -> None:
        try:
            d = self._stager.stage(_rows(chunk), epoch=epoch, node_id=self.node_id)
        except Exception as exc:
            d = fail(exc)
        d.addBoth(self._staged, taken, steps, epoch)

    def _staged(self, staged: Any, taken: list[tuple[Entry, Piece]], steps: Steps, epoch: int) -> None:
        if isinstance(staged, Failure):
            staged = staged.value
        try:
            chunk = steps.send(staged)
        except StopIteration as done:
            self._done(taken, done.value)
        except Exception as exc:  # a bug here must not leave the commit unanswered and the writer stuck
            _log.critical("group commit failed internally: {err}", err=type(exc).__name__)
            self._done(taken, [StoreUnavailable("internal error")] * len(taken))  # AE: resent, never lost
        else:
            self._stage(taken, steps, epoch, chunk)

    def _done(self, taken: list[tuple[Entry, Piece]], outcomes: list[Outcome]) -> None:
        # What queued during this commit goes to the database before these answers go out, so it
        # waits for none of their writes; the idle signal (a clean stop's drain) only after them.
        finished = self._plan.settle(taken, outcomes, now=time.monotonic())
        in_flight = False
        while self._plan and not in_flight:
            in_flight = self._start(self._plan.take())
        self._answer(finished)
        if not in_flight:
            self._next_batch()  # anything submitted by the answers' callbacks, or idle


class IngestService(Service):
    """The group-commit writer for the node's lifetime. It stops after the listeners (their last
    commits drained through `drain`) and before the lease is released.

    On PostgreSQL the writer runs on the reactor (`ReactorIngestWriter`); elsewhere, and with
    ``threaded=True``, in a thread of its own (`IngestWriter`)."""

    def __init__(
        self, store: Callable[[], Store | None], *, threaded: bool | None = None, **settings: Unpack[IntakeSettings]
    ) -> None:
        self.setName("ingest")
        self._store = store
        self._settings = settings
        self._threaded = threaded
        self.writer: IngestWriter | ReactorIngestWriter | None = None

    def startService(self) -> None:
        store = self._store()
        assert store is not None, "the store service starts first"
        threaded = self._threaded
        if threaded is None:
            threaded = not (store.backend == "postgres" and store.dialect.atomic_staging)
        if threaded:
            self.writer = IngestWriter(store, locked_retry_seconds=store.config.busy_retry_seconds, **self._settings)
        else:
            self.writer = ReactorIngestWriter(store, **self._settings)
        self.writer.start()
        super().startService()

    def submit(self, item: Unit) -> Deferred[str]:
        """The writer's `submit`; only the leader's listeners call it, and only while this runs."""
        assert self.writer is not None
        return self.writer.submit(item)

    def drain(self, seconds: float) -> Deferred[bool]:
        """Fires True once every submitted message is committed or rejected, False at `seconds`."""
        if self.writer is None:
            return succeed(True)
        return self.writer.when_idle(seconds)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        writer, self.writer = self.writer, None
        return writer.shutdown() if writer is not None else succeed(None)
