"""The peers on every core (bench/peers/all_cores.py): split over processes they must still do the
one-process peer's work exactly — every message once, no row claimed twice — or the all-core column
of bench/pipeline.py compares against less work than Stageline does."""

from __future__ import annotations

import psycopg

from bench.hl7_corpus import messages as corpus
from bench.peers import all_cores, fhir_peer
from bench.peers.python_pipeline import run
from bench.pipeline import FHIR_SPECS, LOOKUPS, ROUTES, SPECS
from include.transforms_config import parse_transforms


def test_the_in_memory_peer_on_three_processes_does_the_one_process_work():
    payloads = corpus(901, seed=5)  # not a multiple of 3: the last share is shorter
    seconds, counts = all_cores.in_memory(payloads, ROUTES, SPECS, LOOKUPS, workers=3)
    assert counts == run(payloads, ROUTES, SPECS, LOOKUPS)
    assert seconds > 0


def test_the_fhir_peer_on_three_processes_does_the_one_process_work():
    payloads = corpus(901, seed=5)
    options = parse_transforms(FHIR_SPECS)[0].fhir
    _, counts = all_cores.fhir(payloads, options, workers=3)
    assert counts == fhir_peer.run(payloads, options)
    assert counts["bundles"] == 901 and counts["entries"] > 2 * 901


def test_the_durable_peer_on_three_workers_claims_every_row_once(pg_config_fresh):
    cfg = pg_config_fresh
    conninfo = f"host={cfg.server} port={cfg.effective_port} user={cfg.username} dbname={cfg.database}"
    payloads = corpus(1500, seed=7)
    _, counts = all_cores.durable(conninfo, payloads, ROUTES, SPECS, LOOKUPS, workers=3, batch=100)
    with psycopg.connect(conninfo) as conn:
        statuses = dict(conn.execute("SELECT status, count(*) FROM peer_inbound GROUP BY status").fetchall())
        written, sources = conn.execute(
            "SELECT count(*), count(DISTINCT (source_id, destination)) FROM peer_outbound"
        ).fetchone()
    assert counts == run(payloads, ROUTES, SPECS, LOOKUPS)
    assert statuses == {"done": 1500}
    assert written == sources == counts["routed"]
