-- Stageline store, SQLite, version 7: the retention archive and the database-poll watermarks.
--
-- archive_*: retention copies a finished row (with its body) and an old audit event here before it
-- deletes it from the hot tables (include/housekeeping.py). Each archive row keeps the hot row's id
-- as its primary key, so archiving again (a run killed between archive and purge) adds nothing,
-- and its updated_at, so a purge deletes a hot row only while its archived copy is current. Written
-- by retention only, never updated by the stages; `stageline messages show` reads them with the hot
-- tables. Nothing expires here: an archive row stays until an operator removes it.
CREATE TABLE archive_inbound (
    id           INTEGER      PRIMARY KEY,
    message_id   TEXT        NOT NULL,
    control_id   TEXT,
    connection   TEXT        NOT NULL,
    lane_key     TEXT,
    status       TEXT        NOT NULL,
    claim_epoch  INTEGER,
    attempts     INTEGER     NOT NULL,
    created_at   INTEGER NOT NULL,
    updated_at   INTEGER NOT NULL,
    last_error   TEXT,
    charset      TEXT,
    payload      TEXT,
    archived_at  INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
CREATE INDEX archive_inbound_message ON archive_inbound (message_id);
CREATE INDEX archive_inbound_control ON archive_inbound (control_id);

CREATE TABLE archive_routed (
    id           INTEGER      PRIMARY KEY,
    source_id    INTEGER      NOT NULL,
    message_id   TEXT        NOT NULL,
    control_id   TEXT,
    destination  TEXT        NOT NULL,
    route_name   TEXT,
    lane_key     TEXT,
    status       TEXT        NOT NULL,
    claim_epoch  INTEGER,
    attempts     INTEGER     NOT NULL,
    created_at   INTEGER NOT NULL,
    updated_at   INTEGER NOT NULL,
    last_error   TEXT,
    archived_at  INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
CREATE INDEX archive_routed_source ON archive_routed (source_id);

CREATE TABLE archive_outbound (
    id               INTEGER      PRIMARY KEY,
    source_id        INTEGER      NOT NULL,
    message_id       TEXT        NOT NULL,
    control_id       TEXT,
    destination      TEXT        NOT NULL,
    content_type     TEXT        NOT NULL,
    idempotency_key  TEXT        NOT NULL,
    lane_key         TEXT,
    status           TEXT        NOT NULL,
    claim_epoch      INTEGER,
    attempts         INTEGER     NOT NULL,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    last_error       TEXT,
    payload          TEXT,
    archived_at      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
CREATE INDEX archive_outbound_source ON archive_outbound (source_id);

CREATE TABLE archive_events (
    id           INTEGER      PRIMARY KEY,
    at           INTEGER NOT NULL,
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
    detail       TEXT,
    archived_at  INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
CREATE INDEX archive_events_message ON archive_events (message_id, id);

-- inbound_watermarks: a database-poll inbound connection's high-water mark (listeners/dbpoll.py):
-- the key of the last source row it staged, as JSON (a number stays a number); times are epoch milliseconds. Written by the
-- leader only, fenced by its epoch.
CREATE TABLE inbound_watermarks (
    connection  TEXT        PRIMARY KEY,
    watermark   TEXT        NOT NULL,
    epoch       INTEGER      NOT NULL,
    updated_at  INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
