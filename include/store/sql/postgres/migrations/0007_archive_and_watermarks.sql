-- Stageline store, PostgreSQL, version 7: the retention archive and the database-poll watermarks.
--
-- archive_*: retention copies a finished row (with its body) and an old audit event here before it
-- deletes it from the hot tables (include/housekeeping.py). Each archive row keeps the hot row's id
-- as its primary key, so archiving again (a run killed between archive and purge) adds nothing,
-- and its updated_at, so a purge deletes a hot row only while its archived copy is current. Written
-- by retention only, never updated by the stages; `stageline messages show` reads them with the hot
-- tables. Nothing expires here: an archive row stays until an operator removes it.
CREATE TABLE archive_inbound (
    id           bigint      PRIMARY KEY,
    message_id   text        NOT NULL,
    control_id   text,
    connection   text        NOT NULL,
    lane_key     text,
    status       text        NOT NULL,
    claim_epoch  bigint,
    attempts     integer     NOT NULL,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    last_error   text,
    charset      text,
    payload      text,
    archived_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX archive_inbound_message ON archive_inbound (message_id);
CREATE INDEX archive_inbound_control ON archive_inbound (control_id);

CREATE TABLE archive_routed (
    id           bigint      PRIMARY KEY,
    source_id    bigint      NOT NULL,
    message_id   text        NOT NULL,
    control_id   text,
    destination  text        NOT NULL,
    route_name   text,
    lane_key     text,
    status       text        NOT NULL,
    claim_epoch  bigint,
    attempts     integer     NOT NULL,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    last_error   text,
    archived_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX archive_routed_source ON archive_routed (source_id);

CREATE TABLE archive_outbound (
    id               bigint      PRIMARY KEY,
    source_id        bigint      NOT NULL,
    message_id       text        NOT NULL,
    control_id       text,
    destination      text        NOT NULL,
    content_type     text        NOT NULL,
    idempotency_key  text        NOT NULL,
    lane_key         text,
    status           text        NOT NULL,
    claim_epoch      bigint,
    attempts         integer     NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    last_error       text,
    payload          text,
    archived_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX archive_outbound_source ON archive_outbound (source_id);

CREATE TABLE archive_events (
    id           bigint      PRIMARY KEY,
    at           timestamptz NOT NULL,
    stage        text        NOT NULL,
    row_id       bigint      NOT NULL,
    message_id   text        NOT NULL,
    control_id   text,
    destination  text,
    event        text        NOT NULL,
    from_status  text,
    to_status    text        NOT NULL,
    epoch        bigint,
    node_id      text,
    attempt      integer,
    detail       text,
    archived_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX archive_events_message ON archive_events (message_id, id);

-- inbound_watermarks: a database-poll inbound connection's high-water mark (listeners/dbpoll.py):
-- the key of the last source row it staged, as JSON (a number stays a number). Written by the
-- leader only, fenced by its epoch.
CREATE TABLE inbound_watermarks (
    connection  text        PRIMARY KEY,
    watermark   text        NOT NULL,
    epoch       bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
