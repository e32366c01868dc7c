-- Stageline store, SQL Server (T-SQL), version 19: a flagging conformance profile's findings
-- (issue 27; sqlite/migrations/0019_findings.sql says what the column holds).
ALTER TABLE stage_inbound ADD findings nvarchar(max) NULL;
