"""A migrated store filled like one that has run for a day at its rated rate: about a million rows
in the big tables, nearly all of them finished history, and a live backlog on top (what the
statement-plan test, tests/store/test_statement_plans.py, reads plans against).

Built with set-based SQL only (a recursive CTE on SQLite, generate_series on PostgreSQL), ids and
message ids ascending so every index grows at its right-hand edge: seconds, not minutes. The same
shape on both dialects:

  archive_*         what retention moved out before (ids below the hot tables' ids), not yet
                    exported to Parquet, but for one marked export batch (EXPORT_BATCH)
  stage_inbound     N_INBOUND rows, the last INBOUND_OPEN open (pending, in flight under ROUTE_OWNER)
  stage_routed      FANOUT rows per finished inbound row, the last ROUTED_OPEN open
  stage_outbound    FANOUT rows per finished inbound row (~1 M), the last OUTBOUND_OPEN (30,000) open
                    over OUTBOUND_LANES lanes and the NULL lane: heads in flight under DELIVER_OWNER
                    (some with an expired row lease), heads backing off, heads due again, the rest
                    pending; dead letters scattered through the history
  *_bodies          one inbound body per inbound row, one outbound body per transformed outbound row
                    (pass-through rows have none: they send their inbound row's)
  message_events    N_EVENTS of the latest events (retention took the older ones)
  landing_*         one running route / transform run's rows, and leftovers of a run that died
  small tables      leader lease (epoch EPOCH), nodes, lookups, micro-batch history, watermarks

Times are spread over HISTORY_HOURS before now, oldest first, so a retention age of a day
(RETENTION_MS) finds the oldest few percent of the history due, as a store whose retention runs
every few minutes does after a pause.
"""

from __future__ import annotations

from dataclasses import dataclass

EPOCH = 7
ROUTE_OWNER = "airflow:stage_route:r1#1.0"
TRANSFORM_OWNER = "airflow:stage_transform:r1#1.0"
DELIVER_OWNER = "airflow:stage_deliver:r1#1.0"
ROUTE_RUN = "route:airflow:stage_route:r1#1.0:1"
TRANSFORM_RUN = "transform:airflow:stage_transform:r1#1.0:1"
DEAD_RUN = "route:airflow:stage_route:r0#1.0:7"
EXPORT_BATCH = "inbound-e7-20261126T000000-ab12cd34"

ARCHIVED_INBOUND = 300_000  # archive_inbound ids 1..ARCHIVED_INBOUND
ARCHIVED_ROUTED = 300_000  # archive_routed, archive_outbound: ids 1..ARCHIVED_ROUTED
N_INBOUND = 340_000  # stage_inbound ids ARCHIVED_INBOUND+1 ..
INBOUND_OPEN = 4_000  # the newest inbound rows: 3/4 pending, 1/4 in flight
FANOUT = 3  # destinations a message goes to: two transformed, one pass-through
DESTINATIONS = ("ehr", "lab", "archive")
PASSTHROUGH = "archive"
ROUTED_OPEN = 6_000  # the newest routed rows: 3/4 pending, 1/4 in flight
OUTBOUND_OPEN = 30_000  # the newest outbound rows: the deliver backlog
OUTBOUND_LANES = 600  # its lanes, besides the NULL lane (every NULL_LANE_EVERY-th row)
NULL_LANE_EVERY = 20
INBOUND_LANES = 2_000  # PID lanes of the inbound rows (every 10th has none)
CONNECTIONS = ("adt-in", "lab-in", "orm-in", "file-in", "poll-in")
N_EVENTS = 1_000_000
ARCHIVED_EVENTS = 150_000
EXPORT_ROWS = 5_000  # archive_inbound rows marked for the open Parquet export
LANDED = 2_000  # landing rows of the running route / transform run
KEYED_PATIENTS = 50_000  # distinct MRNs in message_keys (about 13 messages each)
HISTORY_HOURS = 25
RETENTION_MS = 24 * 3600 * 1000  # retention age: the oldest hour of the history is due
EXPORT_MS = 3 * 24 * 3600 * 1000  # archive export age

# derived id ranges
INBOUND_FIRST = ARCHIVED_INBOUND + 1
INBOUND_LAST = ARCHIVED_INBOUND + N_INBOUND
INBOUND_DONE = N_INBOUND - INBOUND_OPEN  # inbound rows routed: FANOUT rows each
ROUTED_FIRST = ARCHIVED_INBOUND * FANOUT + 1  # archive_routed holds the ids below
ROUTED_LAST = ROUTED_FIRST + INBOUND_DONE * FANOUT - 1
OUTBOUND_FIRST = ROUTED_FIRST  # the same numbering: outbound k <-> routed k
OUTBOUND_LAST = ROUTED_LAST
EVENTS_FIRST = ARCHIVED_EVENTS + 1


@dataclass(frozen=True)
class Sql:
    """What differs between the two dialects' fill statements."""

    name: str

    def series(self, n: int) -> str:
        if self.name == "sqlite":
            return (
                f"(WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {n}) SELECT i FROM s) AS n"
            )
        return f"generate_series(1, {n}) AS n(i)"

    def ago(self, seconds: str) -> str:
        """A time `seconds` (an SQL expression) before now, in the dialect's timestamp form."""
        if self.name == "sqlite":
            return f"(CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) - CAST(({seconds}) * 1000 AS INTEGER))"
        return f"(now() - make_interval(secs => ({seconds})))"

    def pad(self, expr: str, width: int) -> str:
        if self.name == "sqlite":
            return f"printf('%0{width}d', {expr})"
        return f"lpad(CAST({expr} AS text), {width}, '0')"

    def text(self, expr: str) -> str:
        return f"CAST({expr} AS text)" if self.name == "postgres" else f"CAST({expr} AS TEXT)"

    def insert(self, table: str) -> str:
        """INSERT INTO with explicit ids (PostgreSQL's identity columns are GENERATED ALWAYS)."""
        return f"INSERT INTO {table}"

    def overriding(self, identity: bool) -> str:
        return "OVERRIDING SYSTEM VALUE" if identity and self.name == "postgres" else ""


def _history_age(position: str, count: int) -> str:
    """Seconds before now of the `position`-th (1-based) of `count` rows spread over the history."""
    return f"({HISTORY_HOURS} * 3600.0 * ({count} - ({position})) / {count} + 30)"


def message_id(d: Sql, inbound_id: str) -> str:
    """A 32-character, ascending message id (as listenerd's UUIDv7 ids are)."""
    return f"('m' || {d.pad(inbound_id, 31)})"


def statements(dialect: str) -> list[str]:
    """The fill, in order (run on a freshly migrated store, in one transaction or autocommit)."""
    d = Sql(dialect)
    ov = d.overriding
    mid = lambda expr: message_id(d, expr)  # noqa: E731
    lane_in = lambda k: f"CASE WHEN ({k}) % 10 = 0 THEN NULL ELSE 'PID-' || {d.text(f'({k}) % {INBOUND_LANES}')} END"  # noqa: E731
    conn = lambda k: (  # noqa: E731
        "CASE "
        + " ".join(f"WHEN ({k}) % {len(CONNECTIONS)} = {j} THEN '{c}'" for j, c in enumerate(CONNECTIONS))
        + " END"
    )
    dest = lambda j: (  # noqa: E731
        "CASE " + " ".join(f"WHEN ({j}) = {x} THEN '{c}'" for x, c in enumerate(DESTINATIONS)) + " END"
    )
    payload = "'MSH|^~\\&|LAB|ACME|||20261126120000||ORU^R01|MSG' || {} || '|P|2.5' || char(13) || 'PID|1||12345'"
    if dialect == "postgres":
        payload = payload.replace("char(13)", "chr(13)")
    out: list[str] = []

    # -- the lease, the nodes, the small tables ---------------------------------------------
    if dialect == "sqlite":
        out.append(
            f"UPDATE leader_lease SET owner = 'node-a:1:aa', epoch = {EPOCH}, recovered_epoch = {EPOCH}, "
            f"acquired_at = {d.ago('600')}, renewed_at = {d.ago('1')}, expires_at = NULL WHERE id = 1"
        )
    else:
        out.append(
            f"UPDATE leader_lease SET owner = 'node-a:1:aa', epoch = {EPOCH}, recovered_epoch = {EPOCH}, "
            f"acquired_at = {d.ago('600')}, renewed_at = {d.ago('1')}, expires_at = now() + interval '1 hour' "
            f"WHERE id = 1"
        )
    out.append(
        "INSERT INTO nodes (node_id, host, pid, status, is_leader, config_hash) VALUES "
        "('node-a:1:aa', 'node-a', 1, 'active', " + ("1" if dialect == "sqlite" else "true") + ", 'h1'), "
        "('node-b:2:bb', 'node-b', 2, 'active', " + ("0" if dialect == "sqlite" else "false") + ", 'h1')"
    )
    out.append(
        f"INSERT INTO lookup_entries (table_name, code, value) "
        f"SELECT 'table' || {d.text('n.i % 10')}, 'code' || {d.text('n.i')}, 'value' || {d.text('n.i')} "
        f"FROM {d.series(500)}"
    )
    out.append(
        f"INSERT INTO inbound_watermarks (connection, watermark, epoch) "
        f"SELECT 'poll-' || {d.text('n.i')}, {d.text('n.i * 1000')}, {EPOCH} FROM {d.series(3)}"
    )
    out.append(
        f"INSERT INTO stage_batches (stage, owner, dag_id, run_id, try_number, epoch, started_at, finished_at, "
        f"claimed, counts) "
        f"SELECT 'route', 'airflow:stage_route:r' || {d.text('n.i / 50')} || '#1.' || {d.text('n.i % 50')}, "
        f"'stage_route', 'r' || {d.text('n.i / 50')}, 1, {EPOCH}, {d.ago(_history_age('n.i', 20_000))}, "
        f"{d.ago(_history_age('n.i', 20_000))}, 100, '{{}}' FROM {d.series(20_000)}"
    )

    # -- inbound: archived, hot history, open tail ------------------------------------------
    archived_age = f"{HISTORY_HOURS} * 3600 + 7 * 86400.0 * ({ARCHIVED_INBOUND} - n.i) / {ARCHIVED_INBOUND}"
    out.append(
        f"INSERT INTO archive_inbound (id, message_id, control_id, connection, lane_key, status, claim_epoch, "
        f"attempts, created_at, updated_at, last_error, charset, payload, batch_id, batch_seq, archived_at, "
        f"export_batch) "
        f"SELECT n.i, {mid('n.i')}, 'MSG' || {d.pad('n.i', 9)}, {conn('n.i')}, {lane_in('n.i')}, 'done', "
        f"{EPOCH}, 1, {d.ago(archived_age)}, {d.ago(archived_age)}, "
        f"NULL, 'UTF-8', {payload.format(d.pad('n.i', 9))}, NULL, NULL, "
        f"{d.ago(archived_age)}, "
        f"CASE WHEN n.i <= {EXPORT_ROWS} THEN '{EXPORT_BATCH}' END "
        f"FROM {d.series(ARCHIVED_INBOUND)}"
    )
    k = f"(n.i + {ARCHIVED_INBOUND})"  # the inbound row's id
    open_from = N_INBOUND - INBOUND_OPEN
    out.append(
        f"{d.insert('stage_inbound')} (id, message_id, control_id, connection, lane_key, status, lease_owner, "
        f"lease_expires_at, claim_epoch, attempts, created_at, updated_at, last_error, charset, batch_id, batch_seq) "
        f"{ov(True)} "
        f"SELECT {k}, {mid(k)}, 'MSG' || {d.pad(k, 9)}, {conn(k)}, {lane_in(k)}, "
        f"CASE WHEN n.i > {open_from} + {INBOUND_OPEN * 3 // 4} THEN 'in_flight' WHEN n.i > {open_from} THEN 'pending' "
        f"     WHEN n.i % 1000 = 7 THEN 'dead' WHEN n.i % 200 = 3 THEN 'unrouted' ELSE 'done' END, "
        f"CASE WHEN n.i > {open_from} + {INBOUND_OPEN * 3 // 4} THEN '{ROUTE_OWNER}' END, "
        f"CASE WHEN n.i > {open_from} + {INBOUND_OPEN * 3 // 4} THEN {d.ago('-60')} END, "
        f"CASE WHEN n.i > {open_from} THEN CASE WHEN n.i > {open_from} + {INBOUND_OPEN * 3 // 4} THEN {EPOCH} END "
        f"     ELSE {EPOCH} END, "
        f"CASE WHEN n.i > {open_from} + {INBOUND_OPEN * 3 // 4} OR n.i <= {open_from} THEN 1 ELSE 0 END, "
        f"{d.ago(_history_age('n.i', N_INBOUND))}, {d.ago(_history_age('n.i', N_INBOUND))}, "
        f"CASE WHEN n.i % 1000 = 7 AND n.i <= {open_from} THEN 'no route matched: refused' END, 'UTF-8', "
        f"CASE WHEN n.i % 100 < 10 THEN 'b' || {d.pad(f'{k} / 10', 9)} END, "
        f"CASE WHEN n.i % 100 < 10 THEN n.i % 10 + 1 END "
        f"FROM {d.series(N_INBOUND)}"
    )
    out.append(
        f"INSERT INTO inbound_bodies (id, payload) SELECT {k}, {payload.format(d.pad(k, 9))} FROM {d.series(N_INBOUND)}"
    )
    # a batch record per hot batch, and older ones whose messages retention took already
    out.append(
        "INSERT INTO inbound_batches (batch_id, connection, fhs_control_id, bhs_control_id, declared_count, "
        "message_count, created_at) "
        "SELECT DISTINCT batch_id, connection, 'FHS1', 'BHS1', 10, 10, created_at FROM stage_inbound "
        "WHERE batch_id IS NOT NULL AND batch_seq = 1"
    )
    out.append(
        f"INSERT INTO inbound_batches (batch_id, connection, fhs_control_id, bhs_control_id, declared_count, "
        f"message_count, created_at) "
        f"SELECT 'a' || {d.pad('n.i', 9)}, 'file-in', 'FHS0', 'BHS0', 10, 10, "
        f"{d.ago(f'{HISTORY_HOURS} * 3600 + n.i')} FROM {d.series(300)}"
    )
    out.append(
        f"INSERT INTO archive_inbound_batches (batch_id, connection, fhs_control_id, bhs_control_id, "
        f"declared_count, message_count, created_at, archived_at) "
        f"SELECT 'z' || {d.pad('n.i', 9)}, 'file-in', 'FHS0', 'BHS0', 10, 10, "
        f"{d.ago(f'{HISTORY_HOURS} * 3600 + 86400 + n.i * 60')}, {d.ago(f'{HISTORY_HOURS} * 3600 + 86400 + n.i * 60')} "
        f"FROM {d.series(6_000)}"
    )

    # -- routed and outbound: FANOUT rows per finished inbound row ---------------------------
    # row r (1-based within the hot rows) belongs to inbound row INBOUND_FIRST + (r-1)/FANOUT and
    # destination (r-1) % FANOUT; archived rows likewise below ROUTED_FIRST.
    arch = ARCHIVED_ROUTED
    src_a = f"((n.i - 1) / {FANOUT} + 1)"
    for table in ("archive_routed", "archive_outbound"):
        extra_cols = ", content_type, idempotency_key" if table == "archive_outbound" else ", route_name"
        extra_vals = (
            f", 'application/hl7-v2', {mid(src_a)} || '-' || {dest(f'(n.i - 1) % {FANOUT}')}"
            if table == "archive_outbound"
            else ", 'r-' || " + dest(f"(n.i - 1) % {FANOUT}")
        )
        body = f", {payload.format(d.pad('n.i', 9))}" if table == "archive_outbound" else ""
        out.append(
            f"INSERT INTO {table} (id, source_id, message_id, control_id, destination{extra_cols}, lane_key, status, "
            f"claim_epoch, attempts, created_at, updated_at, last_error{', payload' if body else ''}, archived_at) "
            f"SELECT n.i, {src_a}, {mid(src_a)}, 'MSG' || {d.pad(src_a, 9)}, {dest(f'(n.i - 1) % {FANOUT}')}"
            f"{extra_vals}, {lane_in(src_a)}, 'done', {EPOCH}, 1, "
            f"{d.ago(f'{HISTORY_HOURS} * 3600 + 7 * 86400.0 * ({arch} - n.i) / {arch}')}, "
            f"{d.ago(f'{HISTORY_HOURS} * 3600 + 7 * 86400.0 * ({arch} - n.i) / {arch}')}, NULL{body}, "
            f"{d.ago(f'{HISTORY_HOURS} * 3600 + 7 * 86400.0 * ({arch} - n.i) / {arch}')} "
            f"FROM {d.series(arch)}"
        )
    n_rows = INBOUND_DONE * FANOUT
    rid = f"(n.i + {ROUTED_FIRST - 1})"
    src = f"({INBOUND_FIRST} + (n.i - 1) / {FANOUT})"
    dst = dest(f"(n.i - 1) % {FANOUT}")
    r_open = n_rows - ROUTED_OPEN
    out.append(
        f"{d.insert('stage_routed')} (id, source_id, message_id, control_id, destination, route_name, lane_key, "
        f"status, lease_owner, lease_expires_at, claim_epoch, attempts, created_at, updated_at, last_error) {ov(True)} "
        f"SELECT {rid}, {src}, {mid(src)}, 'MSG' || {d.pad(src, 9)}, {dst}, 'r-' || {dst}, {lane_in(src)}, "
        f"CASE WHEN n.i > {r_open} + {ROUTED_OPEN * 3 // 4} THEN 'in_flight' WHEN n.i > {r_open} THEN 'pending' "
        f"     WHEN n.i % 2000 = 11 THEN 'dead' ELSE 'done' END, "
        f"CASE WHEN n.i > {r_open} + {ROUTED_OPEN * 3 // 4} THEN '{TRANSFORM_OWNER}' END, "
        f"CASE WHEN n.i > {r_open} + {ROUTED_OPEN * 3 // 4} THEN {d.ago('-60')} END, "
        f"CASE WHEN n.i > {r_open} AND n.i <= {r_open} + {ROUTED_OPEN * 3 // 4} THEN NULL ELSE {EPOCH} END, "
        f"CASE WHEN n.i > {r_open} AND n.i <= {r_open} + {ROUTED_OPEN * 3 // 4} THEN 0 ELSE 1 END, "
        f"{d.ago(_history_age('n.i', n_rows))}, {d.ago(_history_age('n.i', n_rows))}, "
        f"CASE WHEN n.i % 2000 = 11 AND n.i <= {r_open} THEN 'transform failed: no PID-3' END "
        f"FROM {d.series(n_rows)}"
    )

    # outbound row r: its lane, and in the open tail (position p from 1) its state
    p = f"(n.i - {n_rows - OUTBOUND_OPEN})"
    lane = f"(n.i % {OUTBOUND_LANES})"
    open_lane = f"CASE WHEN n.i % {NULL_LANE_EVERY} = 0 THEN NULL ELSE {dst} || ':' || {d.text(lane)} END"
    head = f"({p} <= {OUTBOUND_LANES})"  # the first row of each lane in the open tail
    status = (
        f"CASE WHEN {p} <= 0 THEN CASE WHEN n.i % 1000 = 13 THEN 'dead' ELSE 'done' END "
        f"     WHEN {head} AND {lane} % 5 = 0 THEN 'in_flight' "
        f"     WHEN {head} AND {lane} % 7 = 1 THEN 'error' "
        f"     WHEN {head} AND {lane} % 11 = 2 THEN 'error' "
        f"     ELSE 'pending' END"
    )
    out.append(
        f"{d.insert('stage_outbound')} (id, source_id, message_id, control_id, destination, content_type, "
        f"idempotency_key, lane_key, status, lease_owner, lease_expires_at, claim_epoch, attempts, next_attempt_at, "
        f"created_at, updated_at, last_error) {ov(True)} "
        f"SELECT {rid}, {src}, {mid(src)}, 'MSG' || {d.pad(src, 9)}, {dst}, 'application/hl7-v2', "
        f"{mid(src)} || '-' || {dst}, "
        f"CASE WHEN {p} > 0 THEN {open_lane} WHEN n.i % 10 = 0 THEN NULL ELSE {dst} || ':' || {d.text(lane)} END, "
        f"{status}, "
        f"CASE WHEN {p} > 0 AND {head} AND {lane} % 5 = 0 THEN '{DELIVER_OWNER}' END, "
        f"CASE WHEN {p} > 0 AND {head} AND {lane} % 5 = 0 THEN "
        f"     CASE WHEN {lane} % 50 = 0 THEN {d.ago('120')} ELSE {d.ago('-60')} END END, "
        f"CASE WHEN {p} <= 0 OR ({head} AND {lane} % 5 = 0) THEN {EPOCH} END, "
        f"CASE WHEN {p} <= 0 OR ({head} AND ({lane} % 5 = 0 OR {lane} % 7 = 1 OR {lane} % 11 = 2)) THEN 1 ELSE 0 END, "
        f"CASE WHEN {p} > 0 AND {head} AND {lane} % 5 <> 0 AND {lane} % 7 = 1 THEN {d.ago('-120')} "
        f"     WHEN {p} > 0 AND {head} AND {lane} % 5 <> 0 AND {lane} % 11 = 2 THEN {d.ago('5')} END, "
        f"{d.ago(_history_age('n.i', n_rows))}, {d.ago(_history_age('n.i', n_rows))}, "
        f"CASE WHEN {p} <= 0 AND n.i % 1000 = 13 THEN 'AE from ' || {dst} "
        f"     WHEN {p} > 0 AND {head} AND {lane} % 5 <> 0 AND ({lane} % 7 = 1 OR {lane} % 11 = 2) THEN 'HTTP 503' END "
        f"FROM {d.series(n_rows)}"
    )
    out.append(
        f"INSERT INTO outbound_bodies (id, payload) SELECT {rid}, {payload.format(d.pad(src, 9))} "
        f"FROM {d.series(n_rows)} WHERE (n.i - 1) % {FANOUT} <> {DESTINATIONS.index(PASSTHROUGH)}"
    )

    # -- the audit trail: the latest N_EVENTS events, archived ones below -------------------
    for table, first, count in (("archive_events", 1, ARCHIVED_EVENTS), ("message_events", EVENTS_FIRST, N_EVENTS)):
        msg = f"({INBOUND_LAST} - ({N_EVENTS + ARCHIVED_EVENTS} - (n.i + {first - 1})) / 5)"
        age = _history_age(f"n.i + {first - 1}", N_EVENTS + ARCHIVED_EVENTS)
        extra = ", connection, archived_at" if table == "archive_events" else ""
        extra_v = f", {conn(msg)}, {d.ago(age)}" if table == "archive_events" else ""
        out.append(
            f"{d.insert(table)} (id, at, stage, row_id, message_id, control_id, destination, event, from_status, "
            f"to_status, epoch, node_id, attempt, detail{extra}) {ov(table == 'message_events')} "
            f"SELECT n.i + {first - 1}, {d.ago(age)}, "
            f"CASE (n.i % 5) WHEN 0 THEN 'inbound' WHEN 1 THEN 'inbound' WHEN 2 THEN 'routed' ELSE 'outbound' END, "
            f"{msg}, {mid(msg)}, 'MSG' || {d.pad(msg, 9)}, CASE WHEN n.i % 5 >= 2 THEN 'ehr' END, "
            f"CASE (n.i % 5) WHEN 0 THEN 'received' ELSE 'done' END, "
            f"CASE (n.i % 5) WHEN 0 THEN NULL ELSE 'in_flight' END, "
            f"CASE (n.i % 5) WHEN 0 THEN 'pending' ELSE 'done' END, {EPOCH}, '{ROUTE_OWNER}', 1, NULL{extra_v} "
            f"FROM {d.series(count)}"
        )

    # -- landing: the running runs' rows, and a dead run's leftovers -------------------------
    in_flight_in = f"({INBOUND_LAST} - {INBOUND_OPEN // 4} + 1 + (n.i - 1) / 2)"
    out.append(
        f"INSERT INTO landing_routed (run_id, source_id, destination, route_name, status) "
        f"SELECT '{ROUTE_RUN}', {in_flight_in}, CASE WHEN n.i % 2 = 0 THEN 'ehr' ELSE 'archive' END, 'r1', "
        f"CASE WHEN n.i % 50 = 0 THEN 'unrouted' ELSE 'pending' END FROM {d.series(LANDED)}"
    )
    out.append(
        f"INSERT INTO landing_routed (run_id, source_id, destination, route_name, status) "
        f"SELECT '{DEAD_RUN}', {INBOUND_FIRST} + n.i, 'ehr', 'r1', 'pending' FROM {d.series(500)}"
    )
    out.append(
        f"INSERT INTO landing_outbound (run_id, source_id, routed_id, destination, content_type, lane_key, "
        f"payload, message_id, control_id) "
        f"SELECT '{TRANSFORM_RUN}', r.source_id, r.id, r.destination, 'application/hl7-v2', "
        f"COALESCE(r.lane_key, r.destination), "
        f"CASE WHEN r.id % 40 = 0 THEN NULL ELSE 'MSH|transformed' END, r.message_id, r.control_id "
        f"FROM stage_routed r WHERE r.id > {ROUTED_LAST - ROUTED_OPEN // 4} AND r.destination <> '{PASSTHROUGH}'"
    )

    # -- business keys: an MRN of one of KEYED_PATIENTS per message, archived and hot; the catch-up's
    # mark at the open tail
    for source in ("archive_inbound", "stage_inbound"):
        out.append(
            f"INSERT INTO message_keys (message, name, value, received_at, connection) "
            f"SELECT s.id, 'mrn', 'P' || {d.pad(f's.id % {KEYED_PATIENTS}', 6)}, s.created_at, s.connection "
            f"FROM {source} s WHERE s.id <= {INBOUND_LAST - INBOUND_OPEN}"
        )
    mark = INBOUND_LAST - INBOUND_OPEN
    out.append(f"UPDATE key_progress SET last_id = {mark}, until_id = {INBOUND_LAST} WHERE id = 1")

    if dialect == "postgres":
        for table in ("stage_inbound", "stage_routed", "stage_outbound", "message_events", "stage_batches"):
            out.append(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))")
    return out


# What the statements are run with: rows that exist in the fill, in the states a caller meets.
def in_flight_ids(table: str) -> list[int]:
    """Ids of rows the fill has in flight in `table` (under its stage's owner)."""
    if table == "stage_inbound":
        return list(range(INBOUND_LAST - INBOUND_OPEN // 4 + 1, INBOUND_LAST + 1))[:200]
    if table == "stage_routed":
        return list(range(ROUTED_LAST - ROUTED_OPEN // 4 + 1, ROUTED_LAST + 1))[:200]
    return [OUTBOUND_LAST - OUTBOUND_OPEN + 1 + j for j in range(OUTBOUND_LANES) if j % 5 == 0][:100]


OWNERS = {"stage_inbound": ROUTE_OWNER, "stage_routed": TRANSFORM_OWNER, "stage_outbound": DELIVER_OWNER}
