-- Stageline store, SQL Server (T-SQL), version 1. Written for SQL Server 2016 or later (DATEDIFF_BIG,
-- OPENJSON: database compatibility level 130+), never executed here: checked by a parser and review.
-- Timestamps are datetime2(3) in UTC, set from the database clock (SYSUTCDATETIME()); no node clock is
-- ever written. Identifier columns use a binary collation, so equality, uniqueness and lane grouping
-- are exact (case- and accent-sensitive) as with PostgreSQL text, whatever the database default is.
-- Keyed text columns are bounded (index keys are limited to 900/1700 bytes); bodies are nvarchar(max).
-- The migrator runs every batch of this file in one transaction; batches are separated by GO lines.
CREATE TABLE cluster_identity (
    id              smallint      NOT NULL PRIMARY KEY CHECK (id = 1),
    cluster_id      nvarchar(64)  COLLATE Latin1_General_100_BIN2 NOT NULL,
    cluster_name    nvarchar(200) NOT NULL,
    config_version  bigint        NOT NULL DEFAULT 0,
    created_at      datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME()
);
GO

CREATE TABLE leader_lease (
    id               smallint      NOT NULL PRIMARY KEY CHECK (id = 1),
    owner            nvarchar(400) COLLATE Latin1_General_100_BIN2 NULL,
    epoch            bigint        NOT NULL DEFAULT 0,
    acquired_at      datetime2(3)  NULL,
    renewed_at       datetime2(3)  NULL,
    expires_at       datetime2(3)  NULL,
    recovered_epoch  bigint        NOT NULL DEFAULT 0
);
GO

INSERT INTO leader_lease (id) VALUES (1);
GO

CREATE TABLE nodes (
    node_id      nvarchar(400) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY,
    host         nvarchar(255) NOT NULL,
    pid          int           NOT NULL,
    status       nvarchar(16)  NOT NULL CHECK (status IN ('active', 'left')),
    started_at   datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    last_seen    datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    is_leader    bit           NOT NULL DEFAULT 0,
    config_hash  nvarchar(128) NULL
);
GO

CREATE TABLE stage_inbound (
    id                bigint        IDENTITY(1,1) NOT NULL PRIMARY KEY,
    message_id        nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL UNIQUE,
    control_id        nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    connection        nvarchar(200) NOT NULL,
    lane_key          nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    status            nvarchar(16)  NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'in_flight', 'done', 'error', 'dead', 'unrouted')),
    lease_owner       nvarchar(400) COLLATE Latin1_General_100_BIN2 NULL,
    lease_expires_at  datetime2(3)  NULL,
    claim_epoch       bigint        NULL,
    attempts          int           NOT NULL DEFAULT 0,
    next_attempt_at   datetime2(3)  NULL,
    created_at        datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    updated_at        datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    last_error        nvarchar(max) NULL,
    charset           nvarchar(64)  NULL,
    payload           nvarchar(max) NOT NULL
);
GO

CREATE TABLE stage_routed (
    id                bigint        IDENTITY(1,1) NOT NULL PRIMARY KEY,
    source_id         bigint        NOT NULL,
    message_id        nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL,
    control_id        nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    destination       nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    route_name        nvarchar(200) NULL,
    lane_key          nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    status            nvarchar(16)  NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'in_flight', 'done', 'error', 'dead')),
    lease_owner       nvarchar(400) COLLATE Latin1_General_100_BIN2 NULL,
    lease_expires_at  datetime2(3)  NULL,
    claim_epoch       bigint        NULL,
    attempts          int           NOT NULL DEFAULT 0,
    next_attempt_at   datetime2(3)  NULL,
    created_at        datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    updated_at        datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    last_error        nvarchar(max) NULL,
    payload           nvarchar(max) NOT NULL,
    UNIQUE (source_id, destination)
);
GO

CREATE TABLE stage_outbound (
    id                bigint        IDENTITY(1,1) NOT NULL PRIMARY KEY,
    source_id         bigint        NOT NULL,
    message_id        nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL,
    control_id        nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    destination       nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    content_type      nvarchar(200) NOT NULL DEFAULT 'application/hl7-v2',
    idempotency_key   nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL UNIQUE,
    lane_key          nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    status            nvarchar(16)  NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'in_flight', 'done', 'error', 'dead')),
    lease_owner       nvarchar(400) COLLATE Latin1_General_100_BIN2 NULL,
    lease_expires_at  datetime2(3)  NULL,
    claim_epoch       bigint        NULL,
    attempts          int           NOT NULL DEFAULT 0,
    next_attempt_at   datetime2(3)  NULL,
    created_at        datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    updated_at        datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    last_error        nvarchar(max) NULL,
    payload           nvarchar(max) NOT NULL,
    UNIQUE (source_id, destination)
);
GO

-- Claim paths: the claimable set, lane heads, expired leases and stale-epoch recovery each get a
-- filtered index so finished rows (the bulk of a busy table) cost nothing. The claimable index
-- carries next_attempt_at so the backoff check needs no lookup into the clustered index.
CREATE INDEX stage_inbound_claimable  ON stage_inbound (id) INCLUDE (next_attempt_at) WHERE status IN ('pending', 'error');
CREATE INDEX stage_inbound_open_lane  ON stage_inbound (lane_key, id)      WHERE status IN ('pending', 'error', 'in_flight');
CREATE INDEX stage_inbound_in_flight  ON stage_inbound (lease_expires_at)  WHERE status = 'in_flight';
CREATE INDEX stage_inbound_epoch      ON stage_inbound (claim_epoch)       WHERE status = 'in_flight';
CREATE INDEX stage_inbound_control    ON stage_inbound (control_id);
CREATE INDEX stage_inbound_finished   ON stage_inbound (updated_at)        WHERE status IN ('done', 'dead', 'unrouted');
GO

CREATE INDEX stage_routed_claimable   ON stage_routed (id) INCLUDE (next_attempt_at) WHERE status IN ('pending', 'error');
CREATE INDEX stage_routed_open_lane   ON stage_routed (lane_key, id)       WHERE status IN ('pending', 'error', 'in_flight');
CREATE INDEX stage_routed_in_flight   ON stage_routed (lease_expires_at)   WHERE status = 'in_flight';
CREATE INDEX stage_routed_epoch       ON stage_routed (claim_epoch)        WHERE status = 'in_flight';
CREATE INDEX stage_routed_message     ON stage_routed (message_id);
CREATE INDEX stage_routed_finished    ON stage_routed (updated_at)         WHERE status IN ('done', 'dead');
GO

CREATE INDEX stage_outbound_claimable ON stage_outbound (id) INCLUDE (next_attempt_at) WHERE status IN ('pending', 'error');
CREATE INDEX stage_outbound_open_lane ON stage_outbound (lane_key, id)     WHERE status IN ('pending', 'error', 'in_flight');
CREATE INDEX stage_outbound_in_flight ON stage_outbound (lease_expires_at) WHERE status = 'in_flight';
CREATE INDEX stage_outbound_epoch     ON stage_outbound (claim_epoch)      WHERE status = 'in_flight';
CREATE INDEX stage_outbound_message   ON stage_outbound (message_id);
CREATE INDEX stage_outbound_finished  ON stage_outbound (updated_at)       WHERE status IN ('done', 'dead');
GO

-- Append-only audit trail: one row per stage transition.
CREATE TABLE message_events (
    id           bigint        IDENTITY(1,1) NOT NULL PRIMARY KEY,
    at           datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    stage        nvarchar(16)  NOT NULL,
    row_id       bigint        NOT NULL,
    message_id   nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL,
    control_id   nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    destination  nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    event        nvarchar(40)  NOT NULL,
    from_status  nvarchar(16)  NULL,
    to_status    nvarchar(16)  NOT NULL,
    epoch        bigint        NULL,
    node_id      nvarchar(400) COLLATE Latin1_General_100_BIN2 NULL,
    attempt      int           NULL,
    detail       nvarchar(max) NULL
);
GO

CREATE INDEX message_events_message ON message_events (message_id, id);
CREATE INDEX message_events_control ON message_events (control_id, id);
CREATE INDEX message_events_at      ON message_events (at);
