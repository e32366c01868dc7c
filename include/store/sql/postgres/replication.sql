-- The replication posture of the server the store is connected to (include/store/replication.py):
-- whether a commit it reports is also on a synchronous standby. pg_stat_replication's state columns
-- are NULL for a role without pg_read_all_stats, so the query says whether it could see them.

-- name: replication_posture
SELECT current_setting('synchronous_standby_names') AS standby_names,
       current_setting('synchronous_commit') AS synchronous_commit,
       pg_is_in_recovery() AS in_recovery,
       pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') AS can_see,
       (SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming') AS standbys,
       (SELECT count(*) FROM pg_stat_replication
         WHERE state = 'streaming' AND sync_state IN ('sync', 'quorum')) AS sync_standbys;
