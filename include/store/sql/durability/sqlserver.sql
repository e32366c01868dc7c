-- Durability of what the store commits (include/store/durability.py): a database whose
-- DELAYED_DURABILITY is FORCED acknowledges commits before their log is on disk. ALLOWED is
-- durable unless a COMMIT asks otherwise, which Stageline's never do.

-- name: durability_settings
SELECT delayed_durability_desc AS delayed_durability FROM sys.databases WHERE name = DB_NAME();
