-- Stageline store, PostgreSQL, version 18: the route stage indexes the business keys of what it
-- claims (issue 26; include/store/keys.py).
--
-- The key indexer read stage_inbound behind a mark and only messages staged 2 s ago or more; a
-- message whose commit came later than that (a stalled client, a slow ingest commit) was passed by
-- the mark and never indexed. Now the route indexes each batch it claims, so the mark is only the
-- catch-up of what was staged before this version: `until_id`, the newest inbound id now, bounds
-- it (what is newer is claimed by the route, and indexed then).
ALTER TABLE key_progress ADD COLUMN until_id bigint NOT NULL DEFAULT 0;
UPDATE key_progress SET until_id = (SELECT COALESCE(MAX(id), 0) FROM stage_inbound) WHERE id = 1;
