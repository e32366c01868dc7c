-- Stageline store, PostgreSQL, version 20: what a staged body is (issue 27;
-- sqlite/migrations/0020_inbound_format.sql says what the column holds). Adding a nullable column
-- without a default rewrites nothing.
ALTER TABLE stage_inbound ADD COLUMN format text;
