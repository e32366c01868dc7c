"""The durable plain-Python peer for the pipeline benchmark: the python-hl7 loop of
`bench.peers.python_pipeline`, reading from and writing to staged tables with plain SQL.

What a small durable engine without Spark would do: claim a batch of pending inbound rows
(`FOR UPDATE SKIP LOCKED`, so several workers could share the table), route and transform each in
Python, insert one outbound row per destination, mark the inbound rows done, commit — one
transaction per batch, on the same PostgreSQL server as Stageline (fsync and synchronous_commit on).
No lanes, no leader fence, no audit trail, no retries: the floor of "durable between stages".

    load(conn, payloads)             the backlog, in the peer's own tables
    drain(conn, pipeline, batch)     claim → process → insert → finish until nothing is pending
"""

from __future__ import annotations

from typing import Any

from bench.peers.python_pipeline import Pipeline, new_counts

SCHEMA = """
DROP TABLE IF EXISTS peer_inbound, peer_outbound;
CREATE TABLE peer_inbound (id bigserial PRIMARY KEY, status text NOT NULL DEFAULT 'pending', payload text NOT NULL);
CREATE INDEX peer_inbound_pending ON peer_inbound (id) WHERE status = 'pending';
CREATE TABLE peer_outbound (id bigserial PRIMARY KEY, source_id bigint NOT NULL, destination text NOT NULL,
                            status text NOT NULL, payload text);
"""
CLAIM = """UPDATE peer_inbound SET status = 'in_flight'
 WHERE id IN (SELECT id FROM peer_inbound WHERE status = 'pending' ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING id, payload"""
INSERT = "INSERT INTO peer_outbound (source_id, destination, status, payload) VALUES (%s, %s, %s, %s)"
FINISH = "UPDATE peer_inbound SET status = 'done' WHERE id = ANY(%s)"


def load(conn: Any, payloads: list[str]) -> None:
    """Create the peer's tables and stage `payloads` as pending rows (one COPY)."""
    with conn.transaction():
        conn.execute(SCHEMA)
        with conn.cursor().copy("COPY peer_inbound (payload) FROM STDIN") as copy:
            for p in payloads:
                copy.write_row((p,))


def drain(conn: Any, pipeline: Pipeline, *, batch: int = 1000) -> dict[str, int]:
    """Process every pending row, one transaction per batch of `batch` rows; counts."""
    counts = new_counts()
    while True:
        with conn.transaction():
            claimed = conn.execute(CLAIM, (batch,)).fetchall()
            if not claimed:
                return counts
            out = []
            for row_id, payload in claimed:
                for destination, text in pipeline.process(payload, counts):
                    out.append((row_id, destination, "pending" if text is not None else "dead", text))
            with conn.cursor() as cur:
                cur.executemany(INSERT, out)
            conn.execute(FINISH, ([r[0] for r in claimed],))
