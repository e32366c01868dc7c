-- Stageline store, SQLite, version 16: business keys and saved searches (issue 26;
-- postgres/migrations/0016_message_keys.sql says why). Times are epoch milliseconds; TEXT compares
-- byte by byte (BINARY), so a prefix search is an index range.
CREATE TABLE message_keys (
    message      INTEGER NOT NULL,
    name         TEXT    NOT NULL,
    value        TEXT    NOT NULL,
    received_at  INTEGER NOT NULL,
    connection   TEXT    NOT NULL,
    UNIQUE (message, name, value)
);
CREATE INDEX message_keys_search ON message_keys (name, value, received_at);
CREATE INDEX message_keys_received ON message_keys (received_at);

CREATE TABLE key_progress (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    last_id     INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
INSERT INTO key_progress (id, last_id) VALUES (1, 0);

CREATE TABLE saved_searches (
    name        TEXT    PRIMARY KEY,
    query       TEXT    NOT NULL,
    saved_by    TEXT    NOT NULL,
    saved_at    INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
