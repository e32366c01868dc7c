-- Stageline store, PostgreSQL, version 1.
-- Timestamps are timestamptz set from the database clock (now()); no node clock is ever written.

CREATE TABLE cluster_identity (
    id              smallint PRIMARY KEY CHECK (id = 1),
    cluster_id      text        NOT NULL,
    cluster_name    text        NOT NULL,
    config_version  bigint      NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE leader_lease (
    id               smallint PRIMARY KEY CHECK (id = 1),
    owner            text,
    epoch            bigint      NOT NULL DEFAULT 0,
    acquired_at      timestamptz,
    renewed_at       timestamptz,
    expires_at       timestamptz,
    recovered_epoch  bigint      NOT NULL DEFAULT 0
);
INSERT INTO leader_lease (id) VALUES (1);

CREATE TABLE nodes (
    node_id      text PRIMARY KEY,
    host         text        NOT NULL,
    pid          integer     NOT NULL,
    status       text        NOT NULL CHECK (status IN ('active', 'left')),
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_seen    timestamptz NOT NULL DEFAULT now(),
    is_leader    boolean     NOT NULL DEFAULT false,
    config_hash  text
);

CREATE TABLE stage_inbound (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id        text        NOT NULL UNIQUE,
    control_id        text,
    connection        text        NOT NULL,
    lane_key          text,
    status            text        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'in_flight', 'done', 'error', 'dead', 'unrouted')),
    lease_owner       text,
    lease_expires_at  timestamptz,
    claim_epoch       bigint,
    attempts          integer     NOT NULL DEFAULT 0,
    next_attempt_at   timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    last_error        text,
    charset           text,
    payload           text        NOT NULL
);

CREATE TABLE stage_routed (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source_id         bigint      NOT NULL,
    message_id        text        NOT NULL,
    control_id        text,
    destination       text        NOT NULL,
    route_name        text,
    lane_key          text,
    status            text        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'in_flight', 'done', 'error', 'dead')),
    lease_owner       text,
    lease_expires_at  timestamptz,
    claim_epoch       bigint,
    attempts          integer     NOT NULL DEFAULT 0,
    next_attempt_at   timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    last_error        text,
    payload           text        NOT NULL,
    UNIQUE (source_id, destination)
);

CREATE TABLE stage_outbound (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source_id         bigint      NOT NULL,
    message_id        text        NOT NULL,
    control_id        text,
    destination       text        NOT NULL,
    content_type      text        NOT NULL DEFAULT 'application/hl7-v2',
    idempotency_key   text        NOT NULL UNIQUE,
    lane_key          text,
    status            text        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'in_flight', 'done', 'error', 'dead')),
    lease_owner       text,
    lease_expires_at  timestamptz,
    claim_epoch       bigint,
    attempts          integer     NOT NULL DEFAULT 0,
    next_attempt_at   timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    last_error        text,
    payload           text        NOT NULL,
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
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at           timestamptz NOT NULL DEFAULT now(),
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
    detail       text
);
CREATE INDEX message_events_message ON message_events (message_id, id);
CREATE INDEX message_events_control ON message_events (control_id, id);
CREATE INDEX message_events_at      ON message_events (at);
