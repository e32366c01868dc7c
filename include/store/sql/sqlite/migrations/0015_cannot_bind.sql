-- Stageline store, SQLite, version 15: what each node could not bind (issue 24;
-- postgres/migrations/0015_cannot_bind.sql says why).
ALTER TABLE nodes ADD COLUMN cannot_bind TEXT;
