"""The stage records (`include.store.stages`) hold together: one name each, every query a record
names exists in every dialect, and a stage's read query returns exactly the columns of its schema
(on real SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest

from include.store import STAGED_TABLES, Store, queries
from include.store.dialects import DIALECTS
from include.store.lease import acquire_permanent
from include.store.stages import DELIVER, ROUTE, STAGES, TRANSFORM, stage_named


def test_each_stage_has_one_name_and_claims_from_its_own_table_in_pipeline_order() -> None:
    assert [(s.name, s.dag_id, s.input.name) for s in STAGES] == [
        ("route", "stage_route", "stage_inbound"),
        ("transform", "stage_transform", "stage_routed"),
        ("deliver", "stage_deliver", "stage_outbound"),
    ]
    assert [stage_named(s.name) for s in STAGES] == [ROUTE, TRANSFORM, DELIVER]
    assert [s.input for s in STAGES] == list(STAGED_TABLES)


@pytest.mark.parametrize("name", ["inbound", "routes", ""])
def test_a_name_that_is_no_stage_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="unknown stage"):
        stage_named(name)


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_every_query_a_stage_names_exists_in_every_dialect(dialect: str) -> None:
    loaded = queries.load(dialect)
    for stage in STAGES:
        names = [stage.read_query]
        if stage.landing is not None:
            names += [f"{stage.landing.table}_{suffix}" for suffix in ("insert", "delete", "delete_sources")]
        assert [n for n in names if n not in loaded] == [], (dialect, stage.name)


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_a_stage_reads_exactly_the_columns_of_its_schema(store: Store, stage) -> None:
    """The small-batch path picks the schema's columns out of the read query's rows, and Spark's JDBC
    read applies the schema to them: both need the query to return those columns."""
    epoch = acquire_permanent(store, node_id="node-a")
    query = stage.read_sql(store, owner="it's nobody", epoch=epoch)  # a quote to escape, too
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(f"SELECT * FROM ({query}) claimed WHERE 1 = 0")  # our own named query
        got = [d[0] for d in cur.description]
    assert got == stage.columns
