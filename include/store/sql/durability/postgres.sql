-- Durability of what the store commits (include/store/durability.py): read on every new
-- connection; an ingest session never runs with synchronous_commit off or local.

-- name: durability_settings
SELECT current_setting('fsync') AS fsync,
       current_setting('synchronous_commit') AS synchronous_commit,
       current_setting('synchronous_standby_names') AS standby_names;

-- name: pin_synchronous_commit
SELECT set_config('synchronous_commit', :value, false) AS synchronous_commit;
