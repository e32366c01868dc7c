"""The SQL Server dialect, held to the other dialects without a SQL Server.

No SQL Server is available to this project's test run, so nothing here executes T-SQL. Instead
every named query — rendered exactly as `Store.sql` renders it, once per staged table — and every
migration batch must parse with sqlglot's T-SQL reader, and the parse must agree with PostgreSQL:
same query names, same parameters, same result columns, same tables, columns, constraints,
indexes, data moves and views. The text pymssql would really send (its client-side inlining of the parameters) is parsed
too, including negative numbers, which would turn `-:x` into a comment.

sqlglot accepts some statements it does not understand by reading a keyword as a name (THROW in
`IF … THROW …` becomes a column). Every name in the T-SQL files is lower-case and every keyword
upper-case, so an upper-case identifier in a parse tree means the parser misread something, and the
tests refuse it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
import sqlglot
from sqlglot import exp

from include.config import StoreConfig
from include.store import queries
from include.store.db import STAGED_TABLES, StagedTable, Store
from include.store.dialects import DIALECTS, split_tsql_batches

DIALECT_NAMES = ("sqlite", "postgres", "sqlserver")
TSQL = queries.load("sqlserver")
# `audited` wraps a transition and its audit events in one statement where the dialect can
# (PostgreSQL's data-modifying CTE); elsewhere Tx.transition runs the two statements.
# `stage_inbound_one` is PostgreSQL's stage_inbound for a lone message, without the JSON.
# `replication_posture` reads pg_stat_replication: only PostgreSQL is run replicated (issue 28);
# `stage_inbound_resent` makes a re-send's commit wait for the synchronous standby, likewise.
CONTENT_INDEX = frozenset(
    name
    for dialect in ("sqlite", "postgres")
    for name in queries.load(dialect)
    if name.startswith("content_index_") and name != "content_index_present"
)
"""The content index's statements (`stageline messages content-index`), each dialect's own; SQL Server has none."""
ONE_STATEMENT_ONLY = (
    frozenset({"audited", "stage_inbound_one", "content_find_indexed", "replication_posture", "stage_inbound_resent"})
    | CONTENT_INDEX
)
"""Statements not every dialect has: PostgreSQL's one-statement forms, replication posture and re-send wait, and
the content index with the search through it (PostgreSQL's trigram index, SQLite's FTS5)."""
PG = {name: sql for name, sql in queries.load("postgres").items() if name not in ONE_STATEMENT_ONLY}

# sqlglot (30.x) has no THROW statement: it reads `IF @r < 0 THROW 51000, @failed, 1;` as an IF
# whose body is a column named THROW. THROW is valid T-SQL (SQL Server 2012+) and is how the lock
# queries turn a refused sp_getapplock into an error, so this one statement is cut out before
# parsing, in exactly this form and only in these queries, instead of bending the SQL.
THROW_STATEMENT = re.compile(r"^IF @r < 0 THROW 51000, @failed, 1;\n?", re.MULTILINE)
THROWING_QUERIES = frozenset({"migrate_lock", "fence_shared", "fence_exclusive"})
# Lock queries return nothing anybody reads. PostgreSQL's one column is the unnamed advisory-lock
# call; T-SQL's migrate_lock names it `locked`, and the two fence queries, which callers run with
# Tx.execute, return no result set at all (pymssql would cancel unread rows with an attention).
LOCK_QUERIES = THROWING_QUERIES
# Queries only a dialect whose stage_inbound is not one self-contained statement defines: PostgreSQL
# writes the bodies, batch records and events in stage_inbound itself, the others run these next.
SPLIT_STAGING_QUERIES = frozenset({"stage_inbound_bodies", "stage_inbound_batches", "stage_inbound_events"})

# Representative values for every parameter, of the types the callers pass.
SAMPLE_PARAMS: dict[str, Any] = {
    "version": 1,
    "description": "initial",
    "cluster_id": "0b7c6a9e-1f0e-4c1d-9a57-5d4f0c3b2a1e",
    "cluster_name": "o'hare-prod",
    "ms": 20_000,
    "ttl": 30.0,
    "owner": "node-a:123:ab12cd34",
    "epoch": 7,
    "prev_epoch": 6,
    "node_id": "node-a:123:ab12cd34",
    "host": "node-a",
    "pid": 123,
    "is_leader": True,
    "config_hash": None,
    "cannot_bind": None,
    "node_timeout": 30.0,
    "limit": 100,
    "lease_seconds": 60.0,
    "ids": json.dumps([3, 5, 8]),
    "status": "done",
    "error": "HTTP 503 from 'lab'",
    "max_attempts": 5,
    "backoff_seconds": 1.5,
    "max_backoff_seconds": 300.0,
    "run_id": "route:node-a:123:ab12cd34:2024-01-01T12:00:00",
    "message_id": "m-42",
    "control_id": "MSG00042",
    "connection": "mllp-lab",
    "lane_key": None,
    "charset": "UTF-8",
    "payload": "MSH|^~\\&|LAB|ACME|||20240101120000||ORU^R01|MSG00042|P|2.5\r",
    "messages": json.dumps(
        [
            {
                "message_id": "m-42",
                "control_id": "MSG00042",
                "connection": "mllp-lab",
                "lane_key": "PID-7",
                "charset": None,
                "payload": "MSH|^~\\&|O'Neil\r",
            }
        ]
        * 2
    ),
    "rows": json.dumps(
        [{"run_id": "r1", "source_id": 1, "destination": "ehr", "route_name": "adt", "status": "pending"}]
    ),
    "per_lane": 20,
    "max_rows": 5000,
    "names": json.dumps(["archive", "ehr"]),
    "direct": json.dumps(["archive"]),
    "prefix": "airflow:stage_route:",
    "keep": "airflow:stage_route:r1#2.",
    "table_name": "patient_class",
    "entries": json.dumps([{"code": "I", "value": "IN"}]),
    "stage": "routed",
    "event": "finished",
    "from_status": "in_flight",
    # the operator's queries (operator.sql)
    "destination": "ehr",
    "since_ms": 1_700_000_000_000,
    "until_ms": 1_800_000_000_000,
    "before_id": 900,
    "id": 42,
    "new_id": 43,
    "new_message_id": "m-42~replay-1",
    "statuses": json.dumps(["dead"]),
    "actor": "operator:jdoe",
    "detail": "receiver fixed; ticket INC-7",
    "window_ms": 300_000,
    "dag_id": "stage_route",
    "try_number": 1,
    "duration_ms": 270,
    "claimed": 40,
    "counts": json.dumps({"routed": 80}),
    "owners": json.dumps(["airflow:stage_route:r1#1.0"]),
    # retention's archive (archive.sql) and the database-poll watermarks (watermarks.sql)
    "archived": 1,
    "conns": ",adt-in,",
    "within": 0,
    "batch": "inbound-e3-20261124T055130-ab12cd34",
    "kind": "inbound",
    "row_count": 5000,
    "ref": "MSG00042",
    "watermark": json.dumps(1042),
    "batch_id": "f" * 32,
    "part": "day=2026-11-24/connection=adt-in",
    # business keys and saved searches (keys.sql)
    "after_id": 1041,
    "until_id": 2042,
    "last_id": 1042,
    "name": "mrn",
    "lo": "123",
    "hi": "124",
    "query": json.dumps({"key": "mrn=123*"}),
    "after": "mrn-p1",  # a page of the saved searches
    "pattern": "%O'HARA\\_%",
}


def _tsql_store() -> Store:
    # A SQL Server Store connects lazily, on its first transaction: building one here only loads
    # the named queries, so `Store.sql` itself renders the text the driver would get.
    return Store(StoreConfig(backend="sqlserver", server="sqlserver.invalid"))


STORE = _tsql_store()


def _tables(raw: str) -> tuple[StagedTable | None, ...]:
    return STAGED_TABLES if "{" in raw else (None,)


def _cases() -> Iterator[Any]:
    for name in sorted(TSQL):
        for table in _tables(TSQL[name]):
            yield pytest.param(name, table, id=f"{name}[{table.name}]" if table else name)


CASES = list(_cases())


def params_of(raw: str) -> set[str]:
    """The `:name` parameters of a query, found the way the loader finds them."""
    return set(re.findall(r"%\((\w+)\)s", queries.to_pyformat(raw)))


def parse_tsql(sql: str, *, name: str = "") -> list[exp.Expression]:
    """Parse T-SQL (`%(x)s` placeholders written as the T-SQL variables `@x`) and refuse misreads."""
    sql = re.sub(r"%\((\w+)\)s", r"@\1", sql)
    sql, cut = THROW_STATEMENT.subn("", sql)
    if cut:
        assert name in THROWING_QUERIES, f"{name}: THROW is exempted only in {sorted(THROWING_QUERIES)}"
    assert "THROW" not in sql, f"{name}: a THROW not in the one exempted form"
    statements = [s for s in sqlglot.parse(sql, read="tsql", error_level=sqlglot.ErrorLevel.RAISE) if s is not None]
    assert statements, f"{name}: no statement"
    for statement in statements:
        commands = list(statement.find_all(exp.Command))
        assert not commands, f"{name}: sqlglot fell back to an unparsed command: {commands[0].sql()}"
        for ident in statement.find_all(exp.Identifier):
            if ident.find_ancestor(exp.CollateColumnConstraint, exp.SetItem):
                continue  # collation names (Latin1_General_100_BIN2) and SET options (LOCK_TIMEOUT)
            assert ident.name == ident.name.lower(), (
                f"{name}: {ident.name!r} read as a name; the parser misread: {statement.sql('tsql')}"
            )
    return statements


def parse_pg(raw: str, table: StagedTable | None) -> list[exp.Expression]:
    text = raw.format_map(table.template()) if table else raw
    return [s for s in sqlglot.parse(text, read="postgres", error_level=sqlglot.ErrorLevel.RAISE) if s is not None]


def result_sets(statements: list[exp.Expression]) -> list[list[str]]:
    """Column names of each result set the statements return (SELECT lists, RETURNING/OUTPUT)."""
    sets = []
    for statement in statements:
        if isinstance(statement, exp.Query):
            sets.append(list(statement.named_selects))
        elif isinstance(statement, (exp.Insert, exp.Update, exp.Delete, exp.Merge)):
            returning = statement.args.get("returning")
            if returning is not None and not returning.args.get("into"):  # OUTPUT … INTO fills a table
                sets.append([e.alias_or_name for e in returning.expressions])
        elif isinstance(statement, exp.IfBlock):
            for branch in (statement.args.get("true"), statement.args.get("false")):
                if isinstance(branch, exp.Expression):
                    inner = branch.expressions if isinstance(branch, exp.Block) else [branch]
                    assert not result_sets(inner), "a result set inside IF: not one fixed shape"
    return sets


# ---------------------------------------------------------------------------------------------
# the query catalogue


def test_every_dialect_defines_the_same_queries() -> None:
    names = {dialect: set(queries.load(dialect)) - ONE_STATEMENT_ONLY for dialect in DIALECT_NAMES}
    for dialect in DIALECT_NAMES:  # the split-staging queries exactly where staging is split
        if DIALECTS[dialect].atomic_staging:
            assert not names[dialect] & SPLIT_STAGING_QUERIES, dialect
        else:
            assert names[dialect] >= SPLIT_STAGING_QUERIES, dialect
            names[dialect] -= SPLIT_STAGING_QUERIES
    assert names["sqlserver"] == names["postgres"] == names["sqlite"]


@pytest.mark.parametrize("name", sorted(PG))
def test_queries_take_the_same_parameters_in_every_dialect(name: str) -> None:
    by_dialect = {dialect: params_of(queries.load(dialect)[name]) for dialect in DIALECT_NAMES}
    # PostgreSQL writes stage_inbound's audit events in the same statement, so it alone needs node_id
    extra = {"stage_inbound": {"node_id"}}.get(name, set())
    assert by_dialect["sqlserver"] | extra == by_dialect["postgres"] == by_dialect["sqlite"] | extra


@pytest.mark.parametrize("name", sorted(SPLIT_STAGING_QUERIES))
def test_split_staging_queries_take_the_same_parameters_as_sqlite(name: str) -> None:
    assert params_of(TSQL[name]) == params_of(queries.load("sqlite")[name])


@pytest.mark.parametrize("name", sorted(PG) + sorted(SPLIT_STAGING_QUERIES))
def test_queries_use_the_same_staged_table_templates(name: str) -> None:
    def templates(raw: str) -> set[str]:
        return set(re.findall(r"\{(\w+)\}", raw))

    assert templates(TSQL[name]) == templates(PG.get(name) or queries.load("sqlite")[name])


def test_tsql_has_no_literal_percent_sign() -> None:
    # to_pyformat doubles a literal % for the driver, but pymssql never undoubles it: it would
    # reach SQL Server as %%.
    assert [name for name, raw in TSQL.items() if "%" in raw] == []


# ---------------------------------------------------------------------------------------------
# every rendered query parses as T-SQL


@pytest.mark.parametrize("name,table", CASES)
def test_query_parses_as_tsql(name: str, table: StagedTable | None) -> None:
    parse_tsql(STORE.sql(name, table), name=name)


@pytest.mark.parametrize("sign", [1, -1], ids=["typical", "negated"])
@pytest.mark.parametrize("name,table", CASES)
def test_text_pymssql_sends_parses_as_tsql(name: str, table: StagedTable | None, sign: int) -> None:
    mssql = pytest.importorskip("pymssql._mssql")
    params = {p: SAMPLE_PARAMS[p] for p in params_of(TSQL[name])}
    if sign < 0:  # a negative value inlined right after a minus sign would start a `--` comment
        params = {p: -v if isinstance(v, (int, float)) and not isinstance(v, bool) else v for p, v in params.items()}
    text = mssql.substitute_params(STORE.sql(name, table), params).decode()
    assert "--" not in text
    assert "%(" not in text
    parse_tsql(text, name=name)


@pytest.mark.parametrize("name,table", CASES)
def test_query_returns_the_same_columns_as_postgres(name: str, table: StagedTable | None) -> None:
    tsql_sets = result_sets(parse_tsql(STORE.sql(name, table), name=name))
    if name in SPLIT_STAGING_QUERIES:  # no PostgreSQL version: SQLite's
        raw = queries.load("sqlite")[name]
        pg_sets = result_sets(
            [s for s in sqlglot.parse(raw, read="sqlite", error_level=sqlglot.ErrorLevel.RAISE) if s is not None]
        )
    else:
        pg_sets = result_sets(parse_pg(PG[name], table))
    assert len(tsql_sets) <= 1, "one result set at most: Tx reads only the first"
    for columns in tsql_sets:
        assert all(columns) and len(set(columns)) == len(columns), (
            f"unnamed or repeated columns {columns}: pymssql's as_dict needs unique names"
        )
    if name in LOCK_QUERIES:
        assert [len(s) for s in pg_sets] == [1]
        assert [len(s) for s in tsql_sets] in ([], [1])
    else:
        assert tsql_sets == pg_sets


# ---------------------------------------------------------------------------------------------
# the schema

TSQL_TYPE_OF_PG = {
    exp.DataType.Type.TEXT: exp.DataType.Type.NVARCHAR,
    exp.DataType.Type.TIMESTAMPTZ: exp.DataType.Type.DATETIME2,
    exp.DataType.Type.BOOLEAN: exp.DataType.Type.BIT,
    exp.DataType.Type.BIGINT: exp.DataType.Type.BIGINT,
    exp.DataType.Type.INT: exp.DataType.Type.INT,
    exp.DataType.Type.SMALLINT: exp.DataType.Type.SMALLINT,
}
UNBOUNDED_TEXT = {"payload", "last_error", "detail", "findings"}  # findings: up to 20 findings of JSON, over 4000


def tsql_batches() -> list[str]:
    """Every batch of every migration, in version order."""
    return [batch for _, _, script in queries.migrations("sqlserver") for batch in split_tsql_batches(script)]


def tsql_schema_statements() -> list[exp.Expression]:
    return [s for batch in tsql_batches() for s in parse_tsql(batch)]


def pg_schema_statements() -> list[exp.Expression]:
    return [
        s
        for _, _, script in queries.migrations("postgres")
        for s in sqlglot.parse(script, read="postgres", error_level=sqlglot.ErrorLevel.RAISE)
        if s is not None
    ]


def _default(expression: exp.Expression) -> str:
    if isinstance(expression, exp.CurrentTimestamp) or (
        isinstance(expression, exp.Anonymous) and expression.name.upper() == "SYSUTCDATETIME"
    ):
        return "<db clock>"
    if isinstance(expression, exp.Boolean):
        return str(int(expression.this))
    return expression.sql()


def _predicate(where: exp.Expression) -> str:
    """A filter predicate as text, `x IS NOT NULL` in one form: sqlglot's PostgreSQL reader builds a
    negated IS, its T-SQL reader a NOT around an IS."""

    def canonical(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Is) and node.args.get("negate"):
            return exp.Not(this=exp.Is(this=node.this.copy(), expression=node.expression.copy()))
        return node

    return where.copy().transform(canonical).sql()


def _view(select: exp.Expression, tables: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A view's result columns as (name, source table, source column), `alias.*` expanded from the
    table as it is at that point, and its joins. A computed column (COALESCE of a body and its
    source's) is (name, "expression", the table columns it reads)."""
    assert isinstance(select, exp.Select), f"unexpected view body {select.sql()}"
    sources = {t.alias_or_name: t.name for t in select.find_all(exp.Table)}
    columns = []
    for e in select.expressions:
        column = e.unalias()
        if not isinstance(column, exp.Column):
            read = sorted({(sources[c.table], c.name) for c in column.find_all(exp.Column)})
            assert read and all(name in tables[table] for table, name in read), f"a view column reads {read}"
            columns.append((e.alias_or_name, "expression", tuple(read)))
            continue
        source = sources[column.table]
        if isinstance(column.this, exp.Star):
            columns += [(c, source, c) for c in tables[source]]
        else:
            assert column.name in tables[source], f"{source}.{column.name} is not a column"
            columns.append((e.alias_or_name, source, column.name))
    assert len({c[0] for c in columns}) == len(columns), f"repeated view columns {columns}"
    joins = [(j.side, j.this.name, j.args["on"].sql()) for j in select.args.get("joins") or []]
    return {"columns": columns, "from": select.args["from_"].this.name, "joins": joins}


def _column(item: exp.ColumnDef) -> dict[str, Any]:
    kinds = {type(c.kind): c.kind for c in item.constraints}
    default = kinds.get(exp.DefaultColumnConstraint)
    check = kinds.get(exp.CheckColumnConstraint)
    primary = exp.PrimaryKeyColumnConstraint in kinds
    null_rule = kinds.get(exp.NotNullColumnConstraint)  # an explicit NULL is allow_null
    return {
        "type": item.kind,
        "not_null": primary or (null_rule is not None and not null_rule.args.get("allow_null")),
        "primary_key": primary,
        "unique": exp.UniqueColumnConstraint in kinds,
        "identity": exp.GeneratedAsIdentityColumnConstraint in kinds,
        "check": check.this.sql() if check else None,
        "default": _default(default.this) if default else None,
    }


def schema_of(statements: list[exp.Expression]) -> dict[str, Any]:
    """Tables (columns with type, nullability and constraints), table constraints, indexes, rows
    seeded, data moved (INSERT … SELECT, UPDATE), views."""
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    table_uniques: dict[str, list[tuple[str, ...]]] = {}
    indexes: dict[str, dict[str, Any]] = {}
    rows: list[str] = []
    moves: list[str] = []
    views: dict[str, dict[str, Any]] = {}
    for statement in statements:
        if isinstance(statement, exp.Create) and statement.args["kind"] == "TABLE":
            table = statement.this.this.name
            tables[table], table_uniques[table] = {}, []
            for item in statement.this.expressions:
                if isinstance(item, exp.UniqueColumnConstraint):
                    table_uniques[table].append(tuple(i.name for i in item.this.expressions))
                    continue
                assert isinstance(item, exp.ColumnDef), f"{table}: unexpected {item.sql()}"
                tables[table][item.name] = _column(item)
        elif isinstance(statement, exp.Create) and statement.args["kind"] == "INDEX":
            index = statement.this
            where = index.args["params"].args.get("where")
            indexes[index.name] = {
                "table": index.args["table"].name,
                "columns": tuple(c.this.name for c in index.args["params"].args["columns"]),
                "where": _predicate(where.this) if where else None,
            }
        elif isinstance(statement, exp.Create) and statement.args["kind"] == "VIEW":
            views[statement.this.name] = _view(statement.expression, tables)
        elif (isinstance(statement, exp.Insert) and isinstance(statement.expression, exp.Select)) or isinstance(
            statement, exp.Update
        ):  # a backfill (0008: archived rows' batches)
            moves.append(statement.sql(comments=False))
        elif isinstance(statement, exp.Insert):
            rows.append(statement.sql(comments=False))
        elif isinstance(statement, exp.Drop) and statement.args["kind"] == "TABLE":
            [dropped] = [t.name for t in statement.args["tables"]]  # a later migration redoes a table
            tables.pop(dropped), table_uniques.pop(dropped)
            indexes = {k: v for k, v in indexes.items() if v["table"] != dropped}
        elif isinstance(statement, exp.Drop) and statement.args["kind"] == "VIEW":  # redefined next
            [dropped] = [t.name for t in statement.args["tables"]]
            views.pop(dropped)
        elif isinstance(statement, exp.Drop) and statement.args["kind"] == "INDEX":
            [dropped] = [t.name for t in statement.args["tables"]]
            on = statement.find(exp.OnProperty)  # T-SQL names the table: DROP INDEX i ON t
            assert on is None or on.this.name == indexes[dropped]["table"], statement.sql()
            indexes.pop(dropped)
        elif isinstance(statement, exp.Alter) and statement.args["kind"] == "TABLE":
            table = statement.this.name
            for action in statement.args["actions"]:
                if isinstance(action, exp.ColumnDef):  # ADD [COLUMN]
                    tables[table][action.name] = _column(action)
                    continue
                if isinstance(action, exp.AlterSet):  # PostgreSQL's SET UNLOGGED: storage, not shape
                    continue
                assert isinstance(action, exp.Drop) and action.args["kind"] == "COLUMN", (
                    f"unexpected ALTER TABLE in a migration: {statement.sql()}"
                )
                for column in action.args["tables"]:
                    tables[table].pop(column.name)
        elif isinstance(statement, exp.Select) and statement.find(exp.Table) is None:
            pass  # `SELECT 1`: a reserved version's placeholder (migration 0006 on the feeds branch)
        else:
            raise AssertionError(f"unexpected statement in a migration: {statement.sql()}")
    return {
        "tables": tables,
        "table_uniques": table_uniques,
        "indexes": indexes,
        "rows": rows,
        "moves": moves,
        "views": views,
    }


@cache
def tsql_schema() -> dict[str, Any]:
    return schema_of(tsql_schema_statements())


@cache
def pg_schema() -> dict[str, Any]:
    return schema_of(pg_schema_statements())


PG_TABLES = sorted(
    t
    for _, _, script in queries.migrations("postgres")
    for t in re.findall(r"^CREATE TABLE (\w+)", script, re.MULTILINE)
)


def test_every_dialect_has_the_same_migration_versions() -> None:
    versions = {d: [(v, desc) for v, desc, _ in queries.migrations(d)] for d in DIALECT_NAMES}
    assert versions["sqlserver"] == versions["postgres"] == versions["sqlite"]


def test_migration_batches_parse_and_none_is_only_comments() -> None:
    for batch in tsql_batches():
        code = [line for line in batch.splitlines() if line.strip() and not line.strip().startswith("--")]
        assert code, f"a batch of nothing but comments:\n{batch}"
        parse_tsql(batch, name="migration")


def test_migration_creates_the_same_tables_and_columns_as_postgres() -> None:
    assert {t: list(cols) for t, cols in tsql_schema()["tables"].items()} == {
        t: list(cols) for t, cols in pg_schema()["tables"].items()
    }


@pytest.mark.parametrize("table", PG_TABLES)
def test_migration_columns_keep_types_nullability_and_constraints(table: str) -> None:
    for column, pg in pg_schema()["tables"][table].items():
        tsql = tsql_schema()["tables"][table][column]
        where = f"{table}.{column}"
        assert tsql["type"].this == TSQL_TYPE_OF_PG[pg["type"].this], where
        for key in ("not_null", "primary_key", "unique", "identity", "check", "default"):
            assert tsql[key] == pg[key], f"{where}: {key} {tsql[key]!r} != {pg[key]!r}"
    assert tsql_schema()["table_uniques"][table] == pg_schema()["table_uniques"][table]


def _keyed_columns() -> set[tuple[str, str]]:
    keyed = {
        (t, c)
        for t, cols in tsql_schema()["tables"].items()
        for c, shape in cols.items()
        if shape["primary_key"] or shape["unique"]
    }
    keyed |= {(t, c) for t, uniques in tsql_schema()["table_uniques"].items() for u in uniques for c in u}
    keyed |= {(i["table"], c) for i in tsql_schema()["indexes"].values() for c in i["columns"]}
    return keyed


def test_migration_text_columns_are_bounded_where_keyed_and_max_for_bodies() -> None:
    keyed = _keyed_columns()
    for table, columns in tsql_schema()["tables"].items():
        for column, shape in columns.items():
            kind: exp.DataType = shape["type"]
            if kind.this == exp.DataType.Type.DATETIME2:
                assert kind.sql("tsql") == "DATETIME2(3)", f"{table}.{column}"
            if kind.this != exp.DataType.Type.NVARCHAR:
                continue
            [size] = kind.expressions
            if column in UNBOUNDED_TEXT:
                assert size.sql("tsql").upper() == "MAX", f"{table}.{column} holds bodies: nvarchar(max)"
            else:
                assert size.this.is_int, f"{table}.{column}: bounded nvarchar(n)"
                if (table, column) in keyed:  # 450 characters = the 900-byte key limit of any index
                    assert int(size.this.this) <= 450, f"{table}.{column} is an index key"


def test_migration_creates_the_same_indexes_as_postgres() -> None:
    assert tsql_schema()["indexes"] == pg_schema()["indexes"]
    # SQL Server's own since version 13, everyone's since 22 (route_passthrough_open probes it)
    assert "stage_routed_open_destination" in pg_schema()["indexes"]


def test_migration_seeds_the_lease_row() -> None:
    assert (
        tsql_schema()["rows"]
        == pg_schema()["rows"]
        == ["INSERT INTO leader_lease (id) VALUES (1)", "INSERT INTO key_progress (id, last_id) VALUES (1, 0)"]
    )


def test_migration_moves_the_same_data_as_postgres() -> None:
    assert tsql_schema()["moves"] == pg_schema()["moves"]


def test_migration_creates_the_same_views_as_postgres() -> None:
    assert tsql_schema()["views"] == pg_schema()["views"]
    assert set(pg_schema()["views"]) == {"inbound_messages", "routed_messages", "outbound_messages"}
