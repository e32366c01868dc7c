-- Stageline store, PostgreSQL, version 19: a flagging conformance profile's findings (issue 27;
-- sqlite/migrations/0019_findings.sql says what the column holds). Adding a nullable column
-- without a default rewrites nothing.
ALTER TABLE stage_inbound ADD COLUMN findings text;
