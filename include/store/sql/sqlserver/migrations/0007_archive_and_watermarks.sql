-- Stageline store, SQL Server (T-SQL), version 7: the retention archive and the database-poll watermarks.
--
-- archive_*: retention copies a finished row (with its body) and an old audit event here before it
-- deletes it from the hot tables (include/housekeeping.py). Each archive row keeps the hot row's id
-- as its primary key, so archiving again (a run killed between archive and purge) adds nothing,
-- and its updated_at, so a purge deletes a hot row only while its archived copy is current. Written
-- by retention only, never updated by the stages; `stageline messages show` reads them with the hot
-- tables. Nothing expires here: an archive row stays until an operator removes it.
CREATE TABLE archive_inbound (
    id           bigint        NOT NULL PRIMARY KEY,
    message_id   nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL,
    control_id   nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    connection   nvarchar(200) NOT NULL,
    lane_key     nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    status       nvarchar(16)  NOT NULL,
    claim_epoch  bigint        NULL,
    attempts     int           NOT NULL,
    created_at   datetime2(3)  NOT NULL,
    updated_at   datetime2(3)  NOT NULL,
    last_error   nvarchar(max) NULL,
    charset      nvarchar(64)  NULL,
    payload      nvarchar(max) NULL,
    archived_at  datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME()
);
GO

CREATE INDEX archive_inbound_message ON archive_inbound (message_id);
CREATE INDEX archive_inbound_control ON archive_inbound (control_id);
GO

CREATE TABLE archive_routed (
    id           bigint        NOT NULL PRIMARY KEY,
    source_id    bigint        NOT NULL,
    message_id   nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL,
    control_id   nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    destination  nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    route_name   nvarchar(200) NULL,
    lane_key     nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    status       nvarchar(16)  NOT NULL,
    claim_epoch  bigint        NULL,
    attempts     int           NOT NULL,
    created_at   datetime2(3)  NOT NULL,
    updated_at   datetime2(3)  NOT NULL,
    last_error   nvarchar(max) NULL,
    archived_at  datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME()
);
GO

CREATE INDEX archive_routed_source ON archive_routed (source_id);
GO

CREATE TABLE archive_outbound (
    id               bigint        NOT NULL PRIMARY KEY,
    source_id        bigint        NOT NULL,
    message_id       nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL,
    control_id       nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    destination      nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    content_type     nvarchar(200) NOT NULL,
    idempotency_key  nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL,
    lane_key         nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    status           nvarchar(16)  NOT NULL,
    claim_epoch      bigint        NULL,
    attempts         int           NOT NULL,
    created_at       datetime2(3)  NOT NULL,
    updated_at       datetime2(3)  NOT NULL,
    last_error       nvarchar(max) NULL,
    payload          nvarchar(max) NULL,
    archived_at      datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME()
);
GO

CREATE INDEX archive_outbound_source ON archive_outbound (source_id);
GO

CREATE TABLE archive_events (
    id           bigint        NOT NULL PRIMARY KEY,
    at           datetime2(3)  NOT NULL,
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
    detail       nvarchar(max) NULL,
    archived_at  datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME()
);
GO

CREATE INDEX archive_events_message ON archive_events (message_id, id);
GO

-- inbound_watermarks: a database-poll inbound connection's high-water mark (listeners/dbpoll.py):
-- the key of the last source row it staged, as JSON (a number stays a number). Written by the
-- leader only, fenced by its epoch.
CREATE TABLE inbound_watermarks (
    connection  nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY,
    watermark   nvarchar(4000) NOT NULL,
    epoch       bigint        NOT NULL,
    updated_at  datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME()
);
