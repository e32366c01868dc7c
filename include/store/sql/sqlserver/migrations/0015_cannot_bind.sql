-- Stageline store, SQL Server (T-SQL), version 15: what each node could not bind (issue 24;
-- postgres/migrations/0015_cannot_bind.sql says why). A JSON list of inbound names.
ALTER TABLE nodes ADD cannot_bind nvarchar(4000) NULL;
