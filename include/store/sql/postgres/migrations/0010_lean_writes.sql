-- Stageline store, PostgreSQL, version 10: fewer writes per message.
--
-- The landing tables are scratch (one run's Spark output until its finalize moves it): unlogged,
-- so Spark's JDBC append and the finalize's delete write no WAL. After a server crash PostgreSQL
-- empties them; that loses nothing — the runs that had landed rows are unfinished, their claimed
-- rows are handed back or re-pended (row lease, recovery) and run again.
ALTER TABLE landing_routed SET UNLOGGED;
ALTER TABLE landing_outbound SET UNLOGGED;

-- Audit events are the busiest insert of all (one per row per transition): one index fewer.
-- A control id's history goes through its inbound rows (indexed by control id) to their
-- message ids (docs/store.md); every event of a message carries the inbound row's control id.
DROP INDEX message_events_control;

-- Routed and outbound rows are found through their inbound row (source_id, indexed with the
-- destination); nothing looks them up by message id, and every insert and every state change
-- (claim, finish: never HOT, the status is in the partial indexes' predicates) paid an entry.
DROP INDEX stage_routed_message;
DROP INDEX stage_outbound_message;
