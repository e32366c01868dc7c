-- Stageline store, SQLite, version 10: fewer writes per message.
--
-- Audit events are the busiest insert of all (one per row per transition): one index fewer.
-- A control id's history goes through its inbound rows (indexed by control id) to their
-- message ids (docs/store.md); every event of a message carries the inbound row's control id.
-- (PostgreSQL also makes its landing tables unlogged; SQLite has no such thing.)
DROP INDEX message_events_control;

-- Routed and outbound rows are found through their inbound row (source_id, indexed with the
-- destination); nothing looks them up by message id, and every insert and every state change
-- (claim, finish: never HOT, the status is in the partial indexes' predicates) paid an entry.
DROP INDEX stage_routed_message;
DROP INDEX stage_outbound_message;
