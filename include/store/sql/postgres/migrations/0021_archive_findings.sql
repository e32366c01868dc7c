-- Stageline store, PostgreSQL, version 21: retention's archive keeps a message's findings and format
-- (sqlite/migrations/0021_archive_findings.sql says why). Nullable columns without a default rewrite nothing.
ALTER TABLE archive_inbound ADD COLUMN findings text;
ALTER TABLE archive_inbound ADD COLUMN format text;
