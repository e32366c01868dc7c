"""Staging a group commit costs the same per message whatever its size (invariant 13, issue 22).

On SQLite the staging statements run inside the write lock everyone shares, so their cost must be
linear in the messages they stage. The work is counted in SQLite virtual-machine steps (a progress
handler), not seconds: the count is the same on a busy machine and a quiet one. Before the fix,
`stage_inbound_bodies` searched the message-id index by (message_id, rowid) and walked the whole
id list for every message — eight times the messages cost ~60 times the steps (4,000 messages
took 3.2 s inside the lock); now it is about eight times.
"""

from __future__ import annotations

import uuid

from include.store import Store
from include.store.lease import acquire_permanent
from include.store.rowlease import stage_inbound

STEP = 1_000
"""The progress handler fires every STEP virtual-machine instructions."""


def steps_to_stage(store: Store, epoch: int, n: int, *, batch: str | None = None) -> int:
    """VM steps (in units of STEP) SQLite spends staging `n` messages in one group commit."""
    messages = [
        {
            "message_id": uuid.uuid4().hex,
            "control_id": f"C{k}",
            "connection": "mllp-in",
            "lane_key": f"P{k % 50}",
            "charset": None,
            "payload": f"MSH|^~\\&|A|B|C|D|||ADT^A01|C{k}|P|2.5\r" + "PID|1||P1^^^H^MR||DOE^JOHN\r" * 4,
        }
        for k in range(n)
    ]
    if batch is not None:
        for k, m in enumerate(messages, start=1):
            m.update(batch_id=batch, batch_seq=k)
        messages[0].update(batch_size=n, batch_fhs=None, batch_bhs="B1", batch_declared=n)
    counted = [0]

    def tick() -> int:
        counted[0] += 1
        return 0

    with store.transaction() as tx:
        tx.conn.set_progress_handler(tick, STEP)
        try:
            staged = stage_inbound(tx, messages, epoch=epoch, node_id="n")
        finally:
            tx.conn.set_progress_handler(None, STEP)
    assert staged is not None and len(staged) == n
    return counted[0]


def test_a_group_commit_of_eight_times_the_messages_costs_about_eight_times_the_work(sqlite_config_fresh):
    store = Store(sqlite_config_fresh)
    try:
        epoch = acquire_permanent(store, node_id="n")
        small, large = steps_to_stage(store, epoch, 500), steps_to_stage(store, epoch, 4_000)
        assert large / small < 12, f"500 messages: {small} k steps, 4,000: {large} k steps"
    finally:
        store.close()


def test_an_hl7_batch_of_eight_times_the_messages_costs_about_eight_times_the_work(sqlite_config_fresh):
    """A batch also writes its record and events that name it (`stage_inbound_batches`/`_events`)."""
    store = Store(sqlite_config_fresh)
    try:
        epoch = acquire_permanent(store, node_id="n")
        small, large = (
            steps_to_stage(store, epoch, 500, batch="B-small"),
            steps_to_stage(store, epoch, 4_000, batch="B-large"),
        )
        assert large / small < 12, f"500 messages: {small} k steps, 4,000: {large} k steps"
    finally:
        store.close()
