-- Each destination's and each inbound connection's health (include/store/stats.py): what is open
-- now, what finished in a time window, and how long deliveries took. Windows are epoch
-- milliseconds on the database clock ([:since_ms, :until_ms), as SQLite's columns are); every statement reads one partial
-- index of the stages (open rows, dead letters, or the finished rows of the window), never a
-- table. A routed or outbound row's connection is its inbound row's, read by a primary-key probe
-- per row (a scalar subquery: a join would let the planner hash all of stage_inbound).

-- name: stats_open
-- The open rows of {table} (routed or outbound) and its dead letters, per destination,
-- connection and status: how many, the oldest, and how many came in within the window (dead
-- letters are finished rows: stats_finished counts those).
SELECT x.destination, x.connection, x.status, count(*) AS n,
       min(x.created_at) AS oldest_ms, sum(x.recent) AS received
  FROM (SELECT t.destination, t.status, t.created_at,
               (SELECT i.connection FROM stage_inbound i WHERE i.id = t.source_id) AS connection,
               CASE WHEN t.created_at >= :since_ms
                     AND t.created_at < :until_ms THEN 1 ELSE 0 END AS recent
          FROM {table} t
         WHERE t.status IN ('pending', 'error')
        UNION ALL
        SELECT t.destination, t.status, t.created_at,
               (SELECT i.connection FROM stage_inbound i WHERE i.id = t.source_id) AS connection,
               CASE WHEN t.created_at >= :since_ms
                     AND t.created_at < :until_ms THEN 1 ELSE 0 END AS recent
          FROM {table} t
         WHERE t.status = 'in_flight'
        UNION ALL
        SELECT t.destination, t.status, t.created_at,
               (SELECT i.connection FROM stage_inbound i WHERE i.id = t.source_id) AS connection, 0 AS recent
          FROM {table} t
         WHERE t.status = 'dead') x
 GROUP BY x.destination, x.connection, x.status

-- name: stats_inbound_open
-- stats_open for stage_inbound (no destination; its own connection).
SELECT CAST(NULL AS text) AS destination, x.connection, x.status, count(*) AS n,
       min(x.created_at) AS oldest_ms, sum(x.recent) AS received
  FROM (SELECT t.connection, t.status, t.created_at,
               CASE WHEN t.created_at >= :since_ms
                     AND t.created_at < :until_ms THEN 1 ELSE 0 END AS recent
          FROM stage_inbound t
         WHERE t.status IN ('pending', 'error')
        UNION ALL
        SELECT t.connection, t.status, t.created_at,
               CASE WHEN t.created_at >= :since_ms
                     AND t.created_at < :until_ms THEN 1 ELSE 0 END AS recent
          FROM stage_inbound t
         WHERE t.status = 'in_flight'
        UNION ALL
        SELECT t.connection, t.status, t.created_at, 0 AS recent
          FROM stage_inbound t
         WHERE t.status = 'dead') x
 GROUP BY x.connection, x.status

-- name: stats_finished
-- Routed or outbound rows finished since :since_ms, per destination, connection and status: how
-- many came in within the window and how many finished within it (read through the finished
-- index; a row that came in within the window and finished after it is counted as come in).
SELECT x.destination, x.connection, x.status, sum(x.recent) AS received, sum(x.ended) AS finished
  FROM (SELECT t.destination, t.status,
               (SELECT i.connection FROM stage_inbound i WHERE i.id = t.source_id) AS connection,
               CASE WHEN t.created_at >= :since_ms
                     AND t.created_at < :until_ms THEN 1 ELSE 0 END AS recent,
               CASE WHEN t.updated_at < :until_ms THEN 1 ELSE 0 END AS ended
          FROM {table} t
         WHERE t.status IN ('done', 'dead')
           AND t.updated_at >= :since_ms) x
 GROUP BY x.destination, x.connection, x.status

-- name: stats_inbound_finished
-- stats_finished for stage_inbound, whose finished rows include the unrouted (filtered) ones.
SELECT CAST(NULL AS text) AS destination, x.connection, x.status, sum(x.recent) AS received,
       sum(x.ended) AS finished
  FROM (SELECT t.connection, t.status,
               CASE WHEN t.created_at >= :since_ms
                     AND t.created_at < :until_ms THEN 1 ELSE 0 END AS recent,
               CASE WHEN t.updated_at < :until_ms THEN 1 ELSE 0 END AS ended
          FROM stage_inbound t
         WHERE t.status IN ('done', 'dead', 'unrouted')
           AND t.updated_at >= :since_ms) x
 GROUP BY x.connection, x.status

-- name: stats_deliveries
-- The deliveries done within the window, newest first, at most :limit: when each finished and
-- how long it took from the message's arrival (its inbound row's created_at) to the receiver's
-- answer — what the latency percentiles and the histogram are computed from.
SELECT x.destination, x.connection, x.updated_at AS finished_ms,
       x.updated_at - coalesce(x.arrived_at, x.created_at) AS latency_ms
  FROM (SELECT o.destination, o.updated_at, o.created_at,
               (SELECT i.connection FROM stage_inbound i WHERE i.id = o.source_id) AS connection,
               (SELECT i.created_at FROM stage_inbound i WHERE i.id = o.source_id) AS arrived_at
          FROM stage_outbound o
         WHERE o.status IN ('done', 'dead') AND o.status = 'done'
           AND o.updated_at >= :since_ms
           AND o.updated_at < :until_ms
         ORDER BY o.updated_at DESC
         LIMIT :limit) x
 ORDER BY x.updated_at DESC

-- name: stats_per_minute
-- Deliveries done and dead-lettered per destination and minute since :since_ms (the view's chart).
SELECT x.destination, x.status, x.minute_ms, count(*) AS n
  FROM (SELECT o.destination, o.status, (o.updated_at / 60000) * 60000 AS minute_ms
          FROM stage_outbound o
         WHERE o.status IN ('done', 'dead')
           AND o.updated_at >= :since_ms) x
 GROUP BY x.destination, x.status, x.minute_ms
