-- Stageline store, PostgreSQL, version 16: business keys and saved searches (issue 26).
--
-- message_keys: the business keys named in the pipeline's keys.toml (an MRN, an accession number,
-- a visit), one narrow row per message and key, written by the key indexer (include/store/keys.py)
-- a few seconds after the message is staged. `message` is the inbound row's id, which the message
-- keeps in the hot tables, retention's archive and the Parquet archive alike, so one key finds a
-- patient's messages wherever they now are; `received_at` is the message's own received time, so
-- the search's index gives them in time order. `value` compares byte by byte (COLLATE "C"): a
-- prefix search is an index range whatever the database's collation.
CREATE TABLE message_keys (
    message      bigint      NOT NULL,
    name         text        NOT NULL,
    value        text        COLLATE "C" NOT NULL,
    received_at  timestamptz NOT NULL,
    connection   text        NOT NULL,
    UNIQUE (message, name, value)
);
CREATE INDEX message_keys_search ON message_keys (name, value, received_at);
CREATE INDEX message_keys_received ON message_keys (received_at);

-- How far the key indexer has read stage_inbound (one row, id = 1): the last inbound id indexed.
CREATE TABLE key_progress (
    id          integer     PRIMARY KEY CHECK (id = 1),
    last_id     bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO key_progress (id, last_id) VALUES (1, 0);

-- saved_searches: a search an operator named (its query as JSON), shared by the CLI, the API and
-- the Stageline view.
CREATE TABLE saved_searches (
    name        text        PRIMARY KEY,
    query       text        NOT NULL,
    saved_by    text        NOT NULL,
    saved_at    timestamptz NOT NULL DEFAULT now()
);
