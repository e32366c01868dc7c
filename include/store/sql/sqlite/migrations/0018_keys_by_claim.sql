-- Stageline store, SQLite, version 18: the route stage indexes the business keys of what it claims
-- (issue 26; postgres/migrations/0018_keys_by_claim.sql says why).
ALTER TABLE key_progress ADD COLUMN until_id INTEGER NOT NULL DEFAULT 0;
UPDATE key_progress SET until_id = (SELECT COALESCE(MAX(id), 0) FROM stage_inbound) WHERE id = 1;
