-- Stageline store, SQL Server (T-SQL), version 16: business keys and saved searches (issue 26;
-- postgres/migrations/0016_message_keys.sql says why). A binary collation makes a prefix search
-- (LIKE 'abc%') an index range and an exact one case-sensitive, as on the other stores.
CREATE TABLE message_keys (
    message      bigint        NOT NULL,
    name         nvarchar(32)  COLLATE Latin1_General_100_BIN2 NOT NULL,
    value        nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    received_at  datetime2(3)  NOT NULL,
    connection   nvarchar(200) NOT NULL,
    UNIQUE (message, name, value)
);
GO
CREATE INDEX message_keys_search ON message_keys (name, value, received_at);
CREATE INDEX message_keys_received ON message_keys (received_at);
GO

CREATE TABLE key_progress (
    id          int          NOT NULL PRIMARY KEY CHECK (id = 1),
    last_id     bigint       NOT NULL,
    updated_at  datetime2(3) NOT NULL DEFAULT SYSUTCDATETIME()
);
GO
INSERT INTO key_progress (id, last_id) VALUES (1, 0);
GO

CREATE TABLE saved_searches (
    name        nvarchar(100)  COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY,
    query       nvarchar(4000) NOT NULL,
    saved_by    nvarchar(200)  NOT NULL,
    saved_at    datetime2(3)   NOT NULL DEFAULT SYSUTCDATETIME()
);
