"""The durable benchmark peer (bench/peers/durable_pipeline.py) on a real PostgreSQL: it must do the
in-memory peer's work exactly, and leave every row durable and finished, or the comparison is void."""

from __future__ import annotations

import psycopg

from bench.hl7_corpus import messages as corpus
from bench.peers import durable_pipeline
from bench.peers.python_pipeline import Pipeline, run
from bench.pipeline import LOOKUPS, ROUTES, SPECS


def test_the_durable_peer_does_the_in_memory_work_and_finishes_every_row(pg_config_fresh):
    cfg = pg_config_fresh
    payloads = corpus(1200, seed=3)
    with psycopg.connect(host=cfg.server, port=cfg.effective_port, user=cfg.username, dbname=cfg.database) as conn:
        durable_pipeline.load(conn, payloads)
        counts = durable_pipeline.drain(conn, Pipeline(ROUTES, SPECS, LOOKUPS), batch=500)
        statuses = dict(conn.execute("SELECT status, count(*) FROM peer_inbound GROUP BY status").fetchall())
        written = conn.execute("SELECT count(*), sum(length(payload)) FROM peer_outbound").fetchone()
    assert counts == run(payloads, ROUTES, SPECS, LOOKUPS)
    assert statuses == {"done": 1200}
    assert written == (counts["routed"], counts["bytes_out"])
