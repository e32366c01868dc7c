-- Stageline store, SQLite, version 1.
-- Timestamps are INTEGER milliseconds since the Unix epoch (UTC), taken from SQLite's own clock
-- (julianday('now')); this is also the form Spark's JDBC writer produces for SQLite.

CREATE TABLE cluster_identity (
    id              INTEGER PRIMARY KEY CHECK (id = 1),
    cluster_id      TEXT        NOT NULL,
    cluster_name    TEXT        NOT NULL,
    config_version  INTEGER      NOT NULL DEFAULT 0,
    created_at      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);

CREATE TABLE leader_lease (
    id               INTEGER PRIMARY KEY CHECK (id = 1),
    owner            TEXT,
    epoch            INTEGER      NOT NULL DEFAULT 0,
    acquired_at      INTEGER,
    renewed_at       INTEGER,
    expires_at       INTEGER,
    recovered_epoch  INTEGER      NOT NULL DEFAULT 0
);
INSERT INTO leader_lease (id) VALUES (1);

CREATE TABLE nodes (
    node_id      TEXT PRIMARY KEY,
    host         TEXT        NOT NULL,
    pid          INTEGER     NOT NULL,
    status       TEXT        NOT NULL CHECK (status IN ('active', 'left')),
    started_at   INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    last_seen    INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    is_leader    INTEGER     NOT NULL DEFAULT 0,
    config_hash  TEXT
);

CREATE TABLE stage_inbound (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id        TEXT        NOT NULL UNIQUE,
    control_id        TEXT,
    connection        TEXT        NOT NULL,
    lane_key          TEXT,
    status            TEXT        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'in_flight', 'done', 'error', 'dead', 'unrouted')),
    lease_owner       TEXT,
    lease_expires_at  INTEGER,
    claim_epoch       INTEGER,
    attempts          INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at   INTEGER,
    created_at        INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    updated_at        INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    last_error        TEXT,
    charset           TEXT,
    payload           TEXT        NOT NULL
);

CREATE TABLE stage_routed (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    source_id         INTEGER      NOT NULL,
    message_id        TEXT        NOT NULL,
    control_id        TEXT,
    destination       TEXT        NOT NULL,
    route_name        TEXT,
    lane_key          TEXT,
    status            TEXT        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'in_flight', 'done', 'error', 'dead')),
    lease_owner       TEXT,
    lease_expires_at  INTEGER,
    claim_epoch       INTEGER,
    attempts          INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at   INTEGER,
    created_at        INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    updated_at        INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    last_error        TEXT,
    payload           TEXT        NOT NULL,
    UNIQUE (source_id, destination)
);

CREATE TABLE stage_outbound (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    source_id         INTEGER      NOT NULL,
    message_id        TEXT        NOT NULL,
    control_id        TEXT,
    destination       TEXT        NOT NULL,
    content_type      TEXT        NOT NULL DEFAULT 'application/hl7-v2',
    idempotency_key   TEXT        NOT NULL UNIQUE,
    lane_key          TEXT,
    status            TEXT        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'in_flight', 'done', 'error', 'dead')),
    lease_owner       TEXT,
    lease_expires_at  INTEGER,
    claim_epoch       INTEGER,
    attempts          INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at   INTEGER,
    created_at        INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    updated_at        INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    last_error        TEXT,
    payload           TEXT        NOT NULL,
    UNIQUE (source_id, destination)
);

-- Claim paths: the claimable set, lane heads, expired leases and stale-epoch recovery each get a
-- partial index so finished rows (the bulk of a busy table) cost nothing.
CREATE INDEX stage_inbound_claimable  ON stage_inbound (id)                WHERE status IN ('pending', 'error');
CREATE INDEX stage_inbound_open_lane  ON stage_inbound (lane_key, id)      WHERE status IN ('pending', 'error', 'in_flight');
CREATE INDEX stage_inbound_in_flight  ON stage_inbound (lease_expires_at)  WHERE status = 'in_flight';
CREATE INDEX stage_inbound_epoch      ON stage_inbound (claim_epoch)       WHERE status = 'in_flight';
CREATE INDEX stage_inbound_control    ON stage_inbound (control_id);
CREATE INDEX stage_inbound_finished   ON stage_inbound (updated_at)        WHERE status IN ('done', 'dead', 'unrouted');

CREATE INDEX stage_routed_claimable   ON stage_routed (id)                 WHERE status IN ('pending', 'error');
CREATE INDEX stage_routed_open_lane   ON stage_routed (lane_key, id)       WHERE status IN ('pending', 'error', 'in_flight');
CREATE INDEX stage_routed_in_flight   ON stage_routed (lease_expires_at)   WHERE status = 'in_flight';
CREATE INDEX stage_routed_epoch       ON stage_routed (claim_epoch)        WHERE status = 'in_flight';
CREATE INDEX stage_routed_message     ON stage_routed (message_id);
CREATE INDEX stage_routed_finished    ON stage_routed (updated_at)         WHERE status IN ('done', 'dead');

CREATE INDEX stage_outbound_claimable ON stage_outbound (id)               WHERE status IN ('pending', 'error');
CREATE INDEX stage_outbound_open_lane ON stage_outbound (lane_key, id)     WHERE status IN ('pending', 'error', 'in_flight');
CREATE INDEX stage_outbound_in_flight ON stage_outbound (lease_expires_at) WHERE status = 'in_flight';
CREATE INDEX stage_outbound_epoch     ON stage_outbound (claim_epoch)      WHERE status = 'in_flight';
CREATE INDEX stage_outbound_message   ON stage_outbound (message_id);
CREATE INDEX stage_outbound_finished  ON stage_outbound (updated_at)       WHERE status IN ('done', 'dead');

-- Append-only audit trail: one row per stage transition.
CREATE TABLE message_events (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    at           INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    stage        TEXT        NOT NULL,
    row_id       INTEGER      NOT NULL,
    message_id   TEXT        NOT NULL,
    control_id   TEXT,
    destination  TEXT,
    event        TEXT        NOT NULL,
    from_status  TEXT,
    to_status    TEXT        NOT NULL,
    epoch        INTEGER,
    node_id      TEXT,
    attempt      INTEGER,
    detail       TEXT
);
CREATE INDEX message_events_message ON message_events (message_id, id);
CREATE INDEX message_events_control ON message_events (control_id, id);
CREATE INDEX message_events_at      ON message_events (at);
