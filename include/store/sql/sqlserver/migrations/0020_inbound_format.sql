-- Stageline store, SQL Server (T-SQL), version 20: what a staged body is (issue 27;
-- sqlite/migrations/0020_inbound_format.sql says what the column holds).
ALTER TABLE stage_inbound ADD format nvarchar(16) NULL;
