-- Stageline store, SQL Server (T-SQL), version 21: retention's archive keeps a message's findings and
-- format (sqlite/migrations/0021_archive_findings.sql says why).
ALTER TABLE archive_inbound ADD findings nvarchar(max) NULL, format nvarchar(16) NULL;
