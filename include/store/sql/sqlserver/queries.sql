-- Stageline named queries, SQL Server (T-SQL, SQL Server 2016 or later).
-- Parameters are written :name (translated to pymssql's %(name)s at load; pymssql substitutes them
-- client-side as literals); {table} and {dest} are filled from the whitelisted staged-table catalogue,
-- never from input. Times come from SYSUTCDATETIME() and leave as epoch-second floats.
-- Not executed here (no SQL Server available): parsed by sqlglot in tests/store/test_tsql.py.
--
-- Rules this file keeps (see docs/sqlserver.md):
--   * no literal percent sign anywhere: to_pyformat doubles it and pymssql never undoubles it;
--   * never write a minus sign directly before a parameter: pymssql inlines the value, and a negative
--     one would turn the pair into a line comment;
--   * every result column is named (pymssql's as_dict refuses unnamed columns);
--   * OUTPUT can only name inserted./deleted. columns or tables of the FROM clause, so the
--     destination (a column, or NULL for stage_inbound) comes from CROSS APPLY (SELECT {dest} ...) d;
--   * OUTPUT without INTO is refused on a table with an enabled trigger for that action (error 334):
--     the store has no triggers (bodies are deleted by the purge queries, see migration 0004);
--   * the epoch check (EXISTS ... leader_lease ... epoch = :epoch) is a plain read: as on PostgreSQL
--     the fence is the fence_shared / fence_exclusive lock pair the callers take (Tx.fence()).

-- name: bootstrap
-- migrate() takes migrate_lock first, so two nodes never both see the table missing.
IF OBJECT_ID(N'schema_version', N'U') IS NULL
    CREATE TABLE schema_version (
        version      int           NOT NULL PRIMARY KEY,
        description  nvarchar(400) NOT NULL,
        applied_at   datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME()
    );

-- name: migrate_lock
-- pg_advisory_xact_lock: an application lock owned by the transaction, released at commit/rollback.
-- sp_getapplock reports failure only in its return code (and a deadlock does not roll anything
-- back), so a failure is raised here; the message names the equivalent engine error so that
-- SqlServerDialect.is_conflict recognises a timeout (1222) or a deadlock (1205).
DECLARE @r int;
EXEC @r = sp_getapplock @Resource = N'stageline:migrate', @LockMode = N'Exclusive', @LockOwner = N'Transaction';
DECLARE @failed nvarchar(200) = CASE @r
    WHEN -1 THEN N'stageline:migrate lock not granted: lock request time out (as error 1222)'
    WHEN -3 THEN N'stageline:migrate lock not granted: deadlock victim (as error 1205)'
    ELSE CONCAT(N'stageline:migrate lock not granted: sp_getapplock returned ', @r) END;
IF @r < 0 THROW 51000, @failed, 1;
SELECT @r AS locked;

-- name: schema_version_current
SELECT COALESCE(MAX(version), 0) AS version FROM schema_version

-- name: schema_version_record
INSERT INTO schema_version (version, description) VALUES (:version, :description)

-- name: identity_get
SELECT cluster_id, cluster_name, config_version FROM cluster_identity WHERE id = 1

-- name: identity_insert
-- ON CONFLICT DO NOTHING: the key-range lock (UPDLOCK, HOLDLOCK) makes check-then-insert atomic.
INSERT INTO cluster_identity (id, cluster_id, cluster_name)
SELECT 1, :cluster_id, :cluster_name
 WHERE NOT EXISTS (SELECT 1 FROM cluster_identity WITH (UPDLOCK, HOLDLOCK) WHERE id = 1)

-- name: db_now
SELECT CAST(DATEDIFF_BIG(millisecond, '1970-01-01', SYSUTCDATETIME()) / 1000.0 AS float) AS db_now

-- name: step_timeout
-- Bounds the elector step's lock waits (lease row, fence lock) like PostgreSQL's transaction-local
-- statement_timeout. LOCK_TIMEOUT is a session setting: it outlives this transaction on the
-- connection (see docs/sqlserver.md). It takes a literal, which pymssql's inlining provides.
SET LOCK_TIMEOUT :ms;
SELECT @@LOCK_TIMEOUT AS timeout;

-- name: fence_shared
-- Held by every fenced write transaction; an acquisition takes it exclusively before bumping the
-- epoch, so a write that saw epoch E commits before E+1 can. Application locks live in the lock
-- manager only and, unlike a shared lock on the lease row, do not hold up the leader's renewals.
-- Both fence queries return no rows (callers use Tx.execute): an unread result set would make
-- pymssql cancel it with an attention before the next statement.
DECLARE @r int;
EXEC @r = sp_getapplock @Resource = N'stageline:fence', @LockMode = N'Shared', @LockOwner = N'Transaction';
DECLARE @failed nvarchar(200) = CASE @r
    WHEN -1 THEN N'stageline:fence lock not granted: lock request time out (as error 1222)'
    WHEN -3 THEN N'stageline:fence lock not granted: deadlock victim (as error 1205)'
    ELSE CONCAT(N'stageline:fence lock not granted: sp_getapplock returned ', @r) END;
IF @r < 0 THROW 51000, @failed, 1;

-- name: fence_exclusive
DECLARE @r int;
EXEC @r = sp_getapplock @Resource = N'stageline:fence', @LockMode = N'Exclusive', @LockOwner = N'Transaction';
DECLARE @failed nvarchar(200) = CASE @r
    WHEN -1 THEN N'stageline:fence lock not granted: lock request time out (as error 1222)'
    WHEN -3 THEN N'stageline:fence lock not granted: deadlock victim (as error 1205)'
    ELSE CONCAT(N'stageline:fence lock not granted: sp_getapplock returned ', @r) END;
IF @r < 0 THROW 51000, @failed, 1;

-- name: lease_read
SELECT owner, epoch, recovered_epoch,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', acquired_at) / 1000.0 AS float) AS acquired_at,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', expires_at) / 1000.0 AS float) AS expires_at,
       CAST(CASE WHEN owner IS NOT NULL AND (expires_at IS NULL OR expires_at > SYSUTCDATETIME())
                 THEN 1 ELSE 0 END AS bit) AS live,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', SYSUTCDATETIME()) / 1000.0 AS float) AS db_now
  FROM leader_lease WHERE id = 1

-- name: lease_read_locked
-- FOR UPDATE: an update lock (UPDLOCK) held to commit (HOLDLOCK) on the one row (ROWLOCK); a second
-- elector waits here, while plain readers of the lease row are not blocked until the update.
SELECT owner, epoch, recovered_epoch,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', acquired_at) / 1000.0 AS float) AS acquired_at,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', expires_at) / 1000.0 AS float) AS expires_at,
       CAST(CASE WHEN owner IS NOT NULL AND (expires_at IS NULL OR expires_at > SYSUTCDATETIME())
                 THEN 1 ELSE 0 END AS bit) AS live,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', SYSUTCDATETIME()) / 1000.0 AS float) AS db_now
  FROM leader_lease WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE id = 1

-- name: lease_renew
UPDATE leader_lease
   SET renewed_at = SYSUTCDATETIME(),
       expires_at = DATEADD(millisecond, CAST(:ttl * 1000 AS int), SYSUTCDATETIME())
OUTPUT inserted.epoch,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', inserted.expires_at) / 1000.0 AS float) AS expires_at
 WHERE id = 1 AND owner = :owner AND epoch = :epoch AND expires_at > SYSUTCDATETIME()

-- name: lease_acquire
UPDATE leader_lease
   SET owner = :owner, epoch = epoch + 1, acquired_at = SYSUTCDATETIME(), renewed_at = SYSUTCDATETIME(),
       expires_at = DATEADD(millisecond, CAST(:ttl * 1000 AS int), SYSUTCDATETIME())
OUTPUT inserted.epoch,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', inserted.expires_at) / 1000.0 AS float) AS expires_at
 WHERE id = 1 AND epoch = :prev_epoch

-- name: lease_acquire_permanent
UPDATE leader_lease
   SET owner = :owner, epoch = epoch + 1, acquired_at = SYSUTCDATETIME(), renewed_at = SYSUTCDATETIME(),
       expires_at = NULL
OUTPUT inserted.epoch, CAST(NULL AS float) AS expires_at
 WHERE id = 1

-- name: lease_release
UPDATE leader_lease SET expires_at = SYSUTCDATETIME()
 WHERE id = 1 AND owner = :owner AND epoch = :epoch
   AND (expires_at IS NULL OR expires_at > SYSUTCDATETIME())

-- name: node_heartbeat
-- Upsert; HOLDLOCK keeps the key range locked so two heartbeats of one new node cannot both insert.
-- The explicit COLLATE spares the comparison a collation conflict with the derived column.
MERGE INTO nodes WITH (HOLDLOCK) AS n
USING (SELECT :node_id AS node_id, :host AS host, :pid AS pid, :is_leader AS is_leader,
              :config_hash AS config_hash, :cannot_bind AS cannot_bind) AS s
   ON n.node_id = s.node_id COLLATE Latin1_General_100_BIN2
 WHEN MATCHED THEN
      UPDATE SET status = 'active', last_seen = SYSUTCDATETIME(), is_leader = s.is_leader,
                 config_hash = s.config_hash, cannot_bind = s.cannot_bind
 WHEN NOT MATCHED THEN
      INSERT (node_id, host, pid, status, is_leader, config_hash, cannot_bind)
      VALUES (s.node_id, s.host, s.pid, 'active', s.is_leader, s.config_hash, s.cannot_bind);

-- name: node_leave
UPDATE nodes SET status = 'left', is_leader = 0, last_seen = SYSUTCDATETIME() WHERE node_id = :node_id

-- name: nodes_list
SELECT node_id, host, pid, status, is_leader, config_hash, cannot_bind,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', started_at) / 1000.0 AS float) AS started_at,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', last_seen) / 1000.0 AS float) AS last_seen,
       CAST(CASE WHEN status = 'active'
                  AND last_seen > DATEADD(millisecond, CAST(-1000 * :node_timeout AS int), SYSUTCDATETIME())
                 THEN 1 ELSE 0 END AS bit) AS fresh
  FROM nodes ORDER BY nodes.started_at, nodes.node_id

-- name: claim_batch
-- FOR UPDATE SKIP LOCKED: UPDLOCK holds the picked rows to commit, READPAST skips rows another
-- claimer holds, ROWLOCK keeps both at row granularity.
-- Up to :limit due rows in id order, in lane order: a row is skipped while an earlier
-- row of its lane is still open and not claimable now (in_flight, or backing off), so a stranded
-- row is finished before anything newer in its lane moves on. NULL lanes are never held back.
-- The probe states `e.lane_key IS NOT NULL` (implied by the equality) because a filtered index is
-- matched on the query's literal predicates: so it probes the small held_lane index.
UPDATE t
   SET status = 'in_flight', lease_owner = :owner, claim_epoch = :epoch,
       lease_expires_at = DATEADD(millisecond, CAST(:lease_seconds * 1000 AS int), SYSUTCDATETIME()),
       attempts = t.attempts + 1, updated_at = SYSUTCDATETIME()
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.lane_key, inserted.attempts,
       d.destination
  FROM {table} AS t WITH (ROWLOCK)
 CROSS APPLY (SELECT {dest} AS destination) AS d
 WHERE t.id IN (SELECT TOP (:limit) c.id FROM {table} AS c WITH (UPDLOCK, READPAST, ROWLOCK)
                 WHERE c.status IN ('pending', 'error')
                   AND (c.next_attempt_at IS NULL OR c.next_attempt_at <= SYSUTCDATETIME())
                   AND (c.lane_key IS NULL OR NOT EXISTS (SELECT 1 FROM {table} AS e
                                    WHERE e.status IN ('in_flight', 'error') AND e.lane_key IS NOT NULL
                                      AND e.lane_key = c.lane_key
                                      AND e.id < c.id AND (e.status = 'in_flight' OR e.next_attempt_at > SYSUTCDATETIME())))
                 ORDER BY c.id)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: claim_lane_heads
-- Per-lane FIFO: the first :per_lane open rows of up to :limit lanes (lanes ordered by their oldest
-- open row), each lane cut before its first row that is in flight or backing off — so a lane whose
-- head is held gives nothing, and one claim never leaves a gap in a lane. At most :max_rows rows in
-- all, taken round-robin (every lane's first row, then every lane's second, ...), so a cut still
-- leaves each lane a prefix and a one-lane backlog moves :max_rows rows a round, not :per_lane.
-- Two concurrent claimers rank the rows they both see the same way and so take nested prefixes:
-- whatever one took, the other's outer status check (evaluated under the row lock) skips. NULL lane
-- keys form one lane. The held-row probe is two: an equality on the lane (the held-lane index, one
-- seek a candidate) and a branch of its own for the NULL lane — an `OR` of the two, or a NULL-safe
-- comparison, keeps the index out and walks every earlier row of the table for each candidate
-- (issue 22: 34,000 candidates over 150,000 rows held SQLite's write lock for minutes).
-- No READPAST here: skipping a locked row would make the next row of its lane look claimable and
-- break per-lane FIFO.
-- `e.lane_key IS NOT NULL` repeats the held-lane index's filter: SQL Server matches a filtered
-- index on the query's literal predicates only.
UPDATE t
   SET status = 'in_flight', lease_owner = :owner, claim_epoch = :epoch,
       lease_expires_at = DATEADD(millisecond, CAST(:lease_seconds * 1000 AS int), SYSUTCDATETIME()),
       attempts = t.attempts + 1, updated_at = SYSUTCDATETIME()
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.lane_key, inserted.attempts,
       d.destination
  FROM {table} AS t WITH (ROWLOCK)
 CROSS APPLY (SELECT {dest} AS destination) AS d
 WHERE t.id IN (SELECT TOP (:max_rows) x.id
                FROM (SELECT r.id, r.rn, DENSE_RANK() OVER (ORDER BY r.head) AS lane_no
                        FROM (SELECT o.id, o.rn, MIN(o.id) OVER (PARTITION BY o.lane_key) AS head
                                FROM (SELECT id, lane_key, ROW_NUMBER() OVER (PARTITION BY lane_key ORDER BY id) AS rn
                                        FROM {table} WHERE status IN ('pending', 'error', 'in_flight')) AS o
                               WHERE o.rn <= :per_lane
                                 AND NOT EXISTS (SELECT 1 FROM {table} AS e
                                                  WHERE e.status IN ('in_flight', 'error')
                                                    AND e.lane_key = o.lane_key AND e.id <= o.id
                                                    AND e.lane_key IS NOT NULL
                                                    AND (e.status = 'in_flight' OR e.next_attempt_at > SYSUTCDATETIME()))
                                 AND NOT (o.lane_key IS NULL
                                          AND EXISTS (SELECT 1 FROM {table} AS e
                                                       WHERE e.status IN ('in_flight', 'error')
                                                         AND e.lane_key IS NULL AND e.id <= o.id
                                                         AND (e.status = 'in_flight' OR e.next_attempt_at > SYSUTCDATETIME())))) AS r) AS x
               WHERE x.lane_no <= :limit
               ORDER BY x.rn, x.lane_no)
   AND t.status IN ('pending', 'error')
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: finish_batch
UPDATE t
   SET status = :status, lease_owner = NULL, lease_expires_at = NULL, next_attempt_at = NULL,
       last_error = :error, updated_at = SYSUTCDATETIME()
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status,
       d.destination, inserted.last_error AS detail
  FROM {table} AS t WITH (ROWLOCK)
 CROSS APPLY (SELECT {dest} AS destination) AS d
 WHERE t.id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
   AND t.status = 'in_flight' AND t.lease_owner = :owner AND t.claim_epoch = :epoch
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: fail_batch
-- least(a, b) is a CASE (LEAST needs SQL Server 2022); the exponent is capped at 60 so POWER cannot
-- overflow a float for absurd attempt counts (2^60 seconds is far beyond any max_backoff_seconds).
UPDATE t
   SET status = CASE WHEN t.attempts >= :max_attempts THEN 'dead' ELSE 'error' END,
       next_attempt_at = CASE WHEN t.attempts >= :max_attempts THEN NULL
                              ELSE DATEADD(millisecond, CAST(1000 * b.backoff AS int), SYSUTCDATETIME()) END,
       lease_owner = NULL, lease_expires_at = NULL, last_error = :error, updated_at = SYSUTCDATETIME()
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status,
       d.destination, inserted.last_error AS detail
  FROM {table} AS t WITH (ROWLOCK)
 CROSS APPLY (SELECT {dest} AS destination) AS d
 CROSS APPLY (SELECT :backoff_seconds * POWER(CAST(2 AS float),
                     CASE WHEN t.attempts > 61 THEN 60 ELSE t.attempts - 1 END) AS uncapped) AS r
 CROSS APPLY (SELECT CASE WHEN r.uncapped < :max_backoff_seconds THEN r.uncapped
                          ELSE :max_backoff_seconds END AS backoff) AS b
 WHERE t.id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
   AND t.status = 'in_flight' AND t.lease_owner = :owner AND t.claim_epoch = :epoch
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: sweep_expired
-- A row whose claimers keep dying (a poison batch) is dead-lettered once it has used :max_attempts.
-- The leases that ran out first go first: ordered as the in-flight index is, the sweep reads only
-- expired rows (sqlite/queries.sql: in id order SQLite walked the whole table looking for them).
UPDATE t
   SET status = CASE WHEN t.attempts >= :max_attempts THEN 'dead' ELSE 'pending' END,
       lease_owner = NULL, lease_expires_at = NULL, updated_at = SYSUTCDATETIME(),
       last_error = N'row lease of ' + t.lease_owner + N' (epoch '
                    + CAST(t.claim_epoch AS nvarchar(20)) + N') expired'
                    + CASE WHEN t.attempts >= :max_attempts
                           THEN N' after ' + CAST(t.attempts AS nvarchar(20)) + N' attempts' ELSE N'' END
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status,
       d.destination, inserted.last_error AS detail
  FROM {table} AS t WITH (ROWLOCK)
 CROSS APPLY (SELECT {dest} AS destination) AS d
 WHERE t.id IN (SELECT TOP (:limit) id FROM {table} WITH (UPDLOCK, READPAST, ROWLOCK)
                 WHERE status = 'in_flight' AND lease_expires_at <= SYSUTCDATETIME()
                 ORDER BY lease_expires_at, id)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: recovery_mark
UPDATE leader_lease SET recovered_epoch = epoch
OUTPUT inserted.epoch
 WHERE id = 1 AND epoch = :epoch AND recovered_epoch < :epoch

-- name: recover_stale_epoch
-- Lease-blind and lock-waiting (no READPAST): every row of an older epoch must come back.
UPDATE t
   SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL, updated_at = SYSUTCDATETIME(),
       last_error = N'recovered on promotion: claimed by ' + t.lease_owner + N' under epoch '
                    + CAST(t.claim_epoch AS nvarchar(20))
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status,
       d.destination, inserted.last_error AS detail
  FROM {table} AS t
 CROSS APPLY (SELECT {dest} AS destination) AS d
 WHERE t.status = 'in_flight' AND t.claim_epoch < :epoch

-- name: epoch_current
SELECT epoch FROM leader_lease WHERE id = 1 AND epoch = :epoch

-- name: stage_inbound
-- A file re-read after a crash carries the same message_id. ON CONFLICT (message_id) DO NOTHING:
-- NOT EXISTS under a key-range lock (UPDLOCK, HOLDLOCK) skips an id already staged and makes a
-- concurrent insert of the same id wait, then skip; ROW_NUMBER keeps the first of duplicates within
-- the batch. OPENJSON's columns have the database collation, so comparisons name the column's.
-- No body here: stage_inbound_bodies writes them next, in the same transaction (bodies_written 0),
-- and the events follow too (events_recorded 0).
INSERT INTO stage_inbound (message_id, control_id, connection, lane_key, charset, batch_id, batch_seq, findings, format)
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status,
       NULL AS destination, NULL AS detail, CAST(0 AS bit) AS events_recorded,
       CAST(0 AS bit) AS bodies_written
SELECT m.message_id, m.control_id, m.connection, m.lane_key, m.charset, m.batch_id, m.batch_seq, m.findings, m.format
  FROM (SELECT v.message_id, v.control_id, v.connection, v.lane_key, v.charset, v.batch_id, v.batch_seq, v.findings, v.format,
               ROW_NUMBER() OVER (PARTITION BY v.message_id COLLATE Latin1_General_100_BIN2
                                  ORDER BY CAST(j.[key] AS int)) AS nth
          FROM OPENJSON(:messages) AS j
         CROSS APPLY OPENJSON(j.value) WITH (
               message_id  nvarchar(450) '$.message_id',
               control_id  nvarchar(200) '$.control_id',
               connection  nvarchar(200) '$.connection',
               lane_key    nvarchar(200) '$.lane_key',
               charset     nvarchar(64)  '$.charset',
               batch_id    nvarchar(64)  '$.batch_id',
               batch_seq   int           '$.batch_seq',
               findings    nvarchar(max) '$.findings',
               format      nvarchar(16)  '$.format') AS v) AS m
 WHERE m.nth = 1
   AND NOT EXISTS (SELECT 1 FROM stage_inbound AS s WITH (UPDLOCK, HOLDLOCK)
                    WHERE s.message_id = m.message_id COLLATE Latin1_General_100_BIN2)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: stage_inbound_bodies
-- The bodies of the rows stage_inbound has just written (:ids, its OUTPUT). A message id given
-- twice in one batch keeps its first body, as its row kept the first message (the same ROW_NUMBER
-- over the array index). A body already there stays (ON CONFLICT (id) DO NOTHING; the ids are
-- fresh, so this only guards the statement).
INSERT INTO inbound_bodies (id, payload)
SELECT s.id, m.payload
  FROM (SELECT v.message_id, v.payload,
               ROW_NUMBER() OVER (PARTITION BY v.message_id COLLATE Latin1_General_100_BIN2
                                  ORDER BY CAST(j.[key] AS int)) AS nth
          FROM OPENJSON(:messages) AS j
         CROSS APPLY OPENJSON(j.value) WITH (
               message_id  nvarchar(450) '$.message_id',
               payload     nvarchar(max) '$.payload') AS v) AS m
  JOIN stage_inbound AS s ON s.message_id = m.message_id COLLATE Latin1_General_100_BIN2
 WHERE m.nth = 1
   AND s.id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
   AND NOT EXISTS (SELECT 1 FROM inbound_bodies AS b WHERE b.id = s.id)

-- name: stage_inbound_batches
-- The batches among the messages just staged (a batch's first message carries its record), in the
-- same transaction. A file re-read after a crash carries the same batch_id: skipped.
INSERT INTO inbound_batches (batch_id, connection, fhs_control_id, bhs_control_id, declared_count, message_count)
SELECT v.batch_id, v.connection, v.batch_fhs, v.batch_bhs, v.batch_declared, v.batch_size
  FROM OPENJSON(:messages) AS j
 CROSS APPLY OPENJSON(j.value) WITH (
       batch_id        nvarchar(64)  '$.batch_id',
       batch_seq       int           '$.batch_seq',
       connection      nvarchar(200) '$.connection',
       batch_fhs       nvarchar(200) '$.batch_fhs',
       batch_bhs       nvarchar(200) '$.batch_bhs',
       batch_declared  int           '$.batch_declared',
       batch_size      int           '$.batch_size') AS v
 WHERE v.batch_seq = 1
   AND NOT EXISTS (SELECT 1 FROM inbound_batches AS b WITH (UPDLOCK, HOLDLOCK)
                    WHERE b.batch_id = v.batch_id COLLATE Latin1_General_100_BIN2)

-- name: stage_inbound_events
-- The 'received' events of the rows stage_inbound has just written (:ids); a batch message's
-- detail names its batch ("batch <id>: message k of n"), anyone else's is empty.
INSERT INTO message_events (stage, row_id, message_id, control_id, event, to_status, epoch, node_id, attempt,
                            detail)
SELECT 'inbound', t.id, t.message_id, t.control_id, 'received', t.status, CAST(:epoch AS bigint), :node_id,
       t.attempts,
       CASE WHEN t.batch_id IS NULL THEN NULL
            ELSE CONCAT('batch ', t.batch_id, ': message ', t.batch_seq, ' of ',
                        (SELECT b.message_count FROM inbound_batches AS b WHERE b.batch_id = t.batch_id)) END
  FROM stage_inbound AS t
 WHERE t.id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
 ORDER BY t.id

-- name: record_events_for
-- One audit event per row of {table} just transitioned (:ids), built from the row itself: its
-- new status, attempts and last_error (the detail). Only the ids travel to the database.
INSERT INTO message_events (stage, row_id, message_id, control_id, destination, event,
                            from_status, to_status, epoch, node_id, attempt, detail)
SELECT :stage, t.id, t.message_id, t.control_id, {dest}, :event, :from_status, t.status,
       CAST(:epoch AS bigint), :node_id, t.attempts, t.last_error
  FROM {table} AS t
 WHERE t.id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
 ORDER BY t.id

-- name: config_bump
UPDATE cluster_identity SET config_version = config_version + 1
OUTPUT inserted.config_version
WHERE id = 1

-- name: leader_config_hash
SELECT n.config_hash FROM leader_lease AS l JOIN nodes AS n ON n.node_id = l.owner WHERE l.id = 1

-- name: purge_finished_routed
-- Retention: delete up to :limit finished rows unchanged for :ms milliseconds, under the current
-- epoch only (retention is leader work like any other), and return the ids deleted.
-- `done`/`dead` is exactly the predicate of the table's filtered finished index, so the search
-- never reads open rows. The age is applied in whole seconds: DATEADD takes an int, and
-- milliseconds overflow it after 24 days. READPAST skips rows a finalize holds instead of queueing
-- behind it. A routed row has no body of its own (it reads its source's). With :archived = 1 a row
-- goes only once archive.sql has copied it as it is now (same id, same updated_at).
DELETE t
OUTPUT deleted.id
  FROM stage_routed AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM stage_routed AS x WITH (READPAST, ROWLOCK)
                 WHERE x.status IN ('done', 'dead')
                   AND x.updated_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                   AND CASE WHEN CHARINDEX(',' + COALESCE((SELECT i.connection FROM stage_inbound AS i WHERE i.id = x.source_id), (SELECT i.connection FROM archive_inbound AS i WHERE i.id = x.source_id), '') + ',', :conns) > 0 THEN 1 ELSE 0 END = :within
                   AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_routed AS a
                                                  WHERE a.id = x.id AND a.updated_at = x.updated_at)))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: purge_finished_outbound
-- purge_finished_routed for stage_outbound: the rows, then the bodies of exactly the rows deleted
-- (their ids caught by OUTPUT ... INTO), in one batch and transaction; returns the ids. One DML
-- statement has one target in T-SQL, hence the table variable (see migration 0004 on why no
-- trigger does this).
DECLARE @gone TABLE (id bigint NOT NULL PRIMARY KEY);
DELETE t
OUTPUT deleted.id INTO @gone
  FROM stage_outbound AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM stage_outbound AS x WITH (READPAST, ROWLOCK)
                 WHERE x.status IN ('done', 'dead')
                   AND x.updated_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                   AND CASE WHEN CHARINDEX(',' + COALESCE((SELECT i.connection FROM stage_inbound AS i WHERE i.id = x.source_id), (SELECT i.connection FROM archive_inbound AS i WHERE i.id = x.source_id), '') + ',', :conns) > 0 THEN 1 ELSE 0 END = :within
                   AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_outbound AS a
                                                  WHERE a.id = x.id AND a.updated_at = x.updated_at)))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch);
DELETE FROM outbound_bodies WHERE id IN (SELECT id FROM @gone);
SELECT id FROM @gone;

-- name: purge_finished_inbound
-- purge_finished_outbound for stage_inbound, whose finished rows include `unrouted` (its filtered
-- index's exact predicate). A row whose routed rows are still open (pending, in flight, backing
-- off) stays with its body, however old: they read it; so does one with an outbound row that has
-- no body of its own (a pass-through row: its body is this one). That probe takes no READPAST:
-- skipping a locked open routed row would make its source look purgeable.
DECLARE @gone TABLE (id bigint NOT NULL PRIMARY KEY);
DELETE t
OUTPUT deleted.id INTO @gone
  FROM stage_inbound AS t
 WHERE t.id IN (SELECT TOP (:limit) s.id FROM stage_inbound AS s WITH (READPAST, ROWLOCK)
                 WHERE s.status IN ('done', 'dead', 'unrouted')
                   AND s.updated_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                   AND CASE WHEN CHARINDEX(',' + s.connection + ',', :conns) > 0 THEN 1 ELSE 0 END = :within
                   AND NOT EXISTS (SELECT 1 FROM stage_routed AS r
                                    WHERE r.source_id = s.id AND r.status IN ('pending', 'in_flight', 'error'))
                   AND NOT EXISTS (SELECT 1 FROM stage_outbound AS o
                                    WHERE o.source_id = s.id
                                      AND NOT EXISTS (SELECT 1 FROM outbound_bodies AS ob WHERE ob.id = o.id))
                   AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_inbound AS a
                                                  WHERE a.id = s.id AND a.updated_at = s.updated_at)))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch);
DELETE FROM inbound_bodies WHERE id IN (SELECT id FROM @gone);
SELECT id FROM @gone;

-- name: purge_inbound_batches
-- Retention of HL7 batch records: up to :limit inbound_batches rows older than :ms milliseconds
-- none of whose messages' inbound rows is left in stage_inbound (and, with :archived, whose copy is
-- in archive_inbound_batches); returns the batch ids deleted. The probe of
-- stage_inbound takes no READPAST: skipping a locked message row would make its batch look finished.
DELETE t
OUTPUT deleted.batch_id
  FROM inbound_batches AS t
 WHERE t.batch_id IN (SELECT TOP (:limit) b.batch_id FROM inbound_batches AS b WITH (READPAST, ROWLOCK)
                       WHERE b.created_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                         AND NOT EXISTS (SELECT 1 FROM stage_inbound AS s WHERE s.batch_id = b.batch_id)
                         AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_inbound_batches AS a
                                                        WHERE a.batch_id = b.batch_id)))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: purge_events
-- Retention of the audit trail: up to :limit events older than :ms milliseconds (whole seconds);
-- returns the ids deleted.
DELETE e
OUTPUT deleted.id
  FROM message_events AS e
 WHERE e.id IN (SELECT TOP (:limit) x.id FROM message_events AS x WITH (READPAST, ROWLOCK)
                 WHERE x.at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                   AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_events AS a WHERE a.id = x.id)))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- Route stage (include/store/stages.py ROUTE, finalize.py finalize_route). Spark reads the claimed rows
-- with route_read_claimed (its parameters inlined as literals: a JDBC `query` takes none), appends
-- its results to landing_routed, and one fenced transaction finalizes with the queries below.

-- name: route_read_claimed
-- Read-only, so Spark's schema probe running it a second time is harmless; the claim itself
-- happened before, in one statement outside Spark. The connection's name is for conditions that test it.
SELECT s.id, s.connection, b.payload, s.findings, s.format
  FROM stage_inbound AS s JOIN inbound_bodies AS b ON b.id = s.id
 WHERE s.lease_owner = :owner AND s.claim_epoch = :epoch AND s.status = 'in_flight'

-- name: route_read_task
-- The same rows as route_read_claimed, selected by the stage task's owner prefix (each of its batches
-- claims as <prefix><n>, one batch at a time): the same text every batch, so Spark keeps
-- the plan built on it (spark_jobs.stage_job.KeptPlans). A row an earlier batch could not
-- hand back is read again, and ignored: the finalize takes only the batch's claimed ids.
SELECT s.id, s.connection, b.payload, s.findings, s.format
  FROM stage_inbound AS s JOIN inbound_bodies AS b ON b.id = s.id
 WHERE LEFT(s.lease_owner, LEN(:prefix)) = :prefix AND s.claim_epoch = :epoch AND s.status = 'in_flight'

-- name: route_pending_ids
SELECT DISTINCT source_id FROM landing_routed WHERE run_id = :run_id AND status = 'pending'

-- name: route_unrouted_ids
SELECT DISTINCT source_id FROM landing_routed WHERE run_id = :run_id AND status = 'unrouted'

-- name: route_finalize_insert
-- :ids are the sources this transaction has just finished (their rows are locked by that update),
-- so nothing lands for a source whose claim was lost. ON CONFLICT (source_id, destination) DO
-- NOTHING: NOT EXISTS under a key-range lock (UPDLOCK, HOLDLOCK), and ROW_NUMBER keeps one of
-- duplicate landing rows (a retried Spark task). INSERT … SELECT … ORDER BY assigns the identity
-- values in that order, keeping arrival order in the ids. No body is copied: a routed row reads
-- its source's (inbound_bodies).
-- A row bound for one of :direct (pass-through destinations, route_passthrough_open) is routed
-- straight to `done`: the same finalize gives it its outbound row (passthrough_outbound_insert).
INSERT INTO stage_routed (source_id, message_id, control_id, destination, route_name, lane_key, status)
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status,
       inserted.destination, NULL AS detail
SELECT l.source_id, i.message_id, i.control_id, l.destination, l.route_name, i.lane_key,
       CASE WHEN l.destination IN (SELECT CAST(value AS nvarchar(200)) FROM OPENJSON(:direct))
            THEN N'done' ELSE N'pending' END
  FROM (SELECT source_id, destination, route_name,
               ROW_NUMBER() OVER (PARTITION BY source_id, destination ORDER BY source_id) AS nth
          FROM landing_routed
         WHERE run_id = :run_id AND status = 'pending'
           AND source_id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))) AS l
  JOIN stage_inbound AS i ON i.id = l.source_id
 WHERE l.nth = 1
   AND NOT EXISTS (SELECT 1 FROM stage_routed AS r WITH (UPDLOCK, HOLDLOCK)
                    WHERE r.source_id = l.source_id AND r.destination = l.destination)
 ORDER BY l.source_id, l.destination

-- name: route_passthrough_open
-- Of the pass-through destinations (:names), those with routed rows still open: their new rows go
-- through the transform stage like the open ones, so the lane keeps its order (postgres/queries.sql).
-- One read of the open rows through their own filtered index (stage_routed_open_destination,
-- version 13; its filter, as rebuilt in 22, repeated word for word, which is how SQL Server matches
-- a filtered index). One read, not a union of the claimable and in-flight ones: under READ
-- COMMITTED two branches see different moments — a row moving from in_flight to error between them
-- would be missed, and the destination handed on out of lane order.
SELECT DISTINCT destination FROM stage_routed
 WHERE status IN ('pending', 'in_flight', 'error') AND destination <> ''
   AND destination IN (SELECT CAST(value AS nvarchar(200)) FROM OPENJSON(:names))

-- name: landing_routed_delete
DELETE FROM landing_routed WHERE run_id = :run_id

-- name: landing_routed_delete_sources
-- Leftovers of earlier runs that died between landing and finalize, for sources now finished.
DELETE FROM landing_routed WHERE source_id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))

-- name: deliver_read_claimed
-- The deliver stage's read of the lane heads it claimed. Read-only and bounded by owner + epoch (no
-- id list), so it also serves as a Spark JDBC `query` unchanged; no ORDER BY (Spark wraps it in a
-- subquery), the caller orders by id. The body through outbound_messages, the one place that says
-- which it is (a pass-through row has none of its own and sends its inbound row's).
SELECT o.id, o.destination, o.lane_key, o.payload, o.content_type, o.idempotency_key, o.attempts, o.message_id,
       o.control_id
  FROM outbound_messages AS o
 WHERE o.lease_owner = :owner AND o.claim_epoch = :epoch AND o.status = 'in_flight'

-- name: work_pending
-- What a waiting stage run polls: the current epoch (has leadership moved?), whether the lease is
-- live (has the leader died?) and whether any row is due to be claimed (pending, or failed and
-- past its backoff). READPAST: a row being claimed right now is not work for this poll, and a
-- read-committed reader would otherwise wait for it.
SELECT l.epoch,
       CAST(CASE WHEN l.owner IS NOT NULL AND (l.expires_at IS NULL OR l.expires_at > SYSUTCDATETIME())
                 THEN 1 ELSE 0 END AS bit) AS live,
       CAST(CASE WHEN EXISTS (SELECT 1 FROM {table} WITH (READPAST)
                               WHERE status IN ('pending', 'error')
                                 AND (next_attempt_at IS NULL OR next_attempt_at <= SYSUTCDATETIME()))
                 THEN 1 ELSE 0 END AS bit) AS due
  FROM leader_lease AS l WHERE l.id = 1

-- name: transform_read_claimed
-- Read-only (Spark's schema probe may run it twice), bounded by owner + epoch. The body is the
-- routed row's source's.
SELECT r.id, r.source_id, r.destination, b.payload, r.message_id, r.control_id, i.connection
  FROM stage_routed AS r JOIN inbound_bodies AS b ON b.id = r.source_id
  LEFT JOIN stage_inbound AS i ON i.id = r.source_id
 WHERE r.lease_owner = :owner AND r.claim_epoch = :epoch AND r.status = 'in_flight'

-- name: transform_read_task
-- The same rows as transform_read_claimed, selected by the stage task's owner prefix (each of its batches
-- claims as <prefix><n>, one batch at a time): the same text every batch, so Spark keeps
-- the plan built on it (spark_jobs.stage_job.KeptPlans). A row an earlier batch could not
-- hand back is read again, and ignored: the finalize takes only the batch's claimed ids.
SELECT r.id, r.source_id, r.destination, b.payload, r.message_id, r.control_id, i.connection
  FROM stage_routed AS r JOIN inbound_bodies AS b ON b.id = r.source_id
  LEFT JOIN stage_inbound AS i ON i.id = r.source_id
 WHERE LEFT(r.lease_owner, LEN(:prefix)) = :prefix AND r.claim_epoch = :epoch AND r.status = 'in_flight'

-- name: transform_landed
-- One line per routed row this run landed; ok = 0 when the message could not be transformed (or a
-- rule or code hook dead-lettered it), and then detail is why: a NULL payload's content_type
-- carries the reason (spark_jobs/transform_job.py).
SELECT routed_id AS id, min(CASE WHEN payload IS NULL THEN 0 ELSE 1 END) AS ok,
       max(CASE WHEN payload IS NULL THEN content_type END) AS detail
  FROM landing_outbound WHERE run_id = :run_id GROUP BY routed_id

-- name: transform_finalize_insert
-- :ids are the routed rows this transaction has just finished. The idempotency key is the inbound
-- message id and the destination. ON CONFLICT DO NOTHING: NOT EXISTS under a key-range lock, and
-- ROW_NUMBER keeps one of duplicate landing rows; ORDER BY assigns the identity values in routed
-- (arrival) order, which is lane order. The bodies follow in transform_finalize_bodies.
INSERT INTO stage_outbound (source_id, message_id, control_id, destination, content_type, idempotency_key,
                            lane_key)
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status,
       inserted.destination, NULL AS detail
SELECT l.source_id, l.message_id, l.control_id, l.destination, l.content_type,
       l.message_id + N'-' + l.destination, l.lane_key
  FROM (SELECT routed_id, source_id, message_id, control_id, destination, content_type, lane_key,
               ROW_NUMBER() OVER (PARTITION BY routed_id ORDER BY routed_id) AS nth
          FROM landing_outbound
         WHERE run_id = :run_id AND payload IS NOT NULL
           AND routed_id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))) AS l
 WHERE l.nth = 1
   AND NOT EXISTS (SELECT 1 FROM stage_outbound AS o WITH (UPDLOCK, HOLDLOCK)
                    WHERE (o.source_id = l.source_id AND o.destination = l.destination)
                       OR o.idempotency_key = l.message_id + N'-' + l.destination)
 ORDER BY l.routed_id

-- name: transform_finalize_bodies
-- The bodies of the outbound rows transform_finalize_insert has just written (:ids), from the same
-- landed rows (a routed row's source and destination); ROW_NUMBER keeps one of duplicate landing
-- rows. Written once, never rewritten by a state change.
INSERT INTO outbound_bodies (id, payload)
SELECT x.id, x.payload
  FROM (SELECT o.id, l.payload, ROW_NUMBER() OVER (PARTITION BY o.id ORDER BY o.id) AS nth
          FROM stage_outbound AS o
          JOIN landing_outbound AS l ON l.source_id = o.source_id AND l.destination = o.destination
         WHERE o.id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
           AND l.run_id = :run_id AND l.payload IS NOT NULL) AS x
 WHERE x.nth = 1

-- name: transform_passthrough_ids
-- Of the routed rows this run claimed and Spark did not land (:ids), those bound for a destination
-- that passes messages through unchanged (:names: no transform spec, one lane for the destination):
-- the finalize moves them here, in SQL, without Spark reading, rewriting or landing their bodies.
-- Few get here: the route finalize hands most of them on itself (route_passthrough_open).
SELECT id FROM stage_routed
 WHERE id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
   AND destination IN (SELECT CAST(value AS nvarchar(200)) FROM OPENJSON(:names))

-- name: passthrough_outbound_insert
-- The outbound rows of pass-through routed rows this transaction has just finished (:ids) — in the
-- transform finalize, or in the route finalize for rows it routed straight to `done` — in routed
-- (arrival) order: HL7 content type, the destination's own lane, the same idempotency key as
-- the landed path. NOT EXISTS under a key-range lock makes a repeat a no-op.
INSERT INTO stage_outbound (source_id, message_id, control_id, destination, content_type, idempotency_key,
                            lane_key)
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status,
       inserted.destination, NULL AS detail
SELECT r.source_id, r.message_id, r.control_id, r.destination, N'application/hl7-v2',
       r.message_id + N'-' + r.destination, r.destination
  FROM stage_routed AS r
 WHERE r.id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
   AND NOT EXISTS (SELECT 1 FROM stage_outbound AS o WITH (UPDLOCK, HOLDLOCK)
                    WHERE (o.source_id = r.source_id AND o.destination = r.destination)
                       OR o.idempotency_key = r.message_id + N'-' + r.destination)
 ORDER BY r.id

-- name: landing_outbound_delete
DELETE FROM landing_outbound WHERE run_id = :run_id

-- name: landing_outbound_delete_sources
-- Leftovers of earlier runs that died between landing and finalize, for routed rows now finished.
DELETE FROM landing_outbound WHERE routed_id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))

-- name: lookup_entries_all
SELECT table_name, code, value FROM lookup_entries ORDER BY table_name, code

-- name: lookup_tables
SELECT table_name, COUNT(*) AS entries,
       CAST(DATEDIFF_BIG(millisecond, '1970-01-01', MAX(updated_at)) AS float) / 1000.0 AS updated_at
  FROM lookup_entries GROUP BY table_name ORDER BY table_name

-- name: lookup_delete_table
DELETE FROM lookup_entries WHERE table_name = :table_name

-- name: lookup_insert
-- :entries is a JSON array of {"code", "value"} objects: one statement per table, however large.
INSERT INTO lookup_entries (table_name, code, value)
SELECT :table_name, e.code, e.value
  FROM OPENJSON(:entries) WITH (code nvarchar(200) '$.code', value nvarchar(1000) '$.value') AS e

-- name: landing_routed_insert
-- The small-batch path: a run of a few rows lands them in one statement instead of a Spark JDBC
-- write (a Spark job of its own). :rows is a JSON array of landing rows.
INSERT INTO landing_routed (run_id, source_id, destination, route_name, status)
SELECT r.run_id, r.source_id, r.destination, r.route_name, r.status
  FROM OPENJSON(:rows) WITH (
       run_id       nvarchar(200) '$.run_id',
       source_id    bigint        '$.source_id',
       destination  nvarchar(200) '$.destination',
       route_name   nvarchar(200) '$.route_name',
       status       nvarchar(16)  '$.status') AS r

-- name: landing_outbound_insert
INSERT INTO landing_outbound (run_id, source_id, routed_id, destination, content_type, lane_key, payload,
                              message_id, control_id)
SELECT r.run_id, r.source_id, r.routed_id, r.destination, r.content_type, r.lane_key, r.payload,
       r.message_id, r.control_id
  FROM OPENJSON(:rows) WITH (
       run_id        nvarchar(200) '$.run_id',
       source_id     bigint        '$.source_id',
       routed_id     bigint        '$.routed_id',
       destination   nvarchar(200) '$.destination',
       content_type  nvarchar(200) '$.content_type',
       lane_key      nvarchar(200) '$.lane_key',
       payload       nvarchar(max) '$.payload',
       message_id    nvarchar(450) '$.message_id',
       control_id    nvarchar(200) '$.control_id') AS r

-- name: release_batch
-- Hand claimed rows back untouched (claimed but never attempted: an earlier row of their lane
-- failed first): pending again, the claim's attempt not counted.
UPDATE {table}
   SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL, attempts = attempts - 1,
       updated_at = SYSUTCDATETIME()
OUTPUT inserted.id
 WHERE id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids)) AND status = 'in_flight'
   AND lease_owner = :owner AND claim_epoch = :epoch
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: renew_claims
-- A live stage task keeps its claim: the rows it holds get a fresh row lease, so only a claimer
-- that stopped renewing (its process died) lets its rows expire.
UPDATE {table}
   SET lease_expires_at = DATEADD(millisecond, CAST(:lease_seconds * 1000 AS int), SYSUTCDATETIME())
 WHERE status = 'in_flight' AND lease_owner = :owner AND claim_epoch = :epoch
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: recover_abandoned
-- Owner-scoped recovery: re-pend the rows held by earlier tasks of one stage DAG (owners starting
-- with :prefix), except the asking task's own (owners starting with :keep). Airflow starts a task
-- of a stage DAG only after the previous one ended (one run at a time, a retry after the try
-- failed), so those claimers are dead. Poison rows are dead-lettered as the sweep does.
UPDATE t
   SET status = CASE WHEN t.attempts >= :max_attempts THEN 'dead' ELSE 'pending' END,
       lease_owner = NULL, lease_expires_at = NULL, updated_at = SYSUTCDATETIME(),
       last_error = N'recovered: its claimer ' + t.lease_owner + N' (epoch '
                    + CAST(t.claim_epoch AS nvarchar(20)) + N') has ended'
                    + CASE WHEN t.attempts >= :max_attempts
                           THEN N' after ' + CAST(t.attempts AS nvarchar(20)) + N' attempts' ELSE N'' END
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status,
       d.destination, inserted.last_error AS detail
  FROM {table} AS t WITH (ROWLOCK)
 CROSS APPLY (SELECT {dest} AS destination) AS d
 WHERE t.status = 'in_flight' AND LEFT(t.lease_owner, LEN(:prefix)) = :prefix
   AND LEFT(t.lease_owner, LEN(:keep)) <> :keep
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: lease_watch
-- What a running stage task checks every heartbeat: has the epoch moved on, has the lease lapsed.
SELECT epoch, CAST(CASE WHEN owner IS NOT NULL AND (expires_at IS NULL OR expires_at > SYSUTCDATETIME())
                        THEN 1 ELSE 0 END AS bit) AS live
  FROM leader_lease WHERE id = 1

-- name: read_timeout
-- LOCK_TIMEOUT is what a session can set (Store.bounded): a wait on a lock ends after :ms, a scan does not.
SET LOCK_TIMEOUT :ms;
SELECT @@LOCK_TIMEOUT AS timeout;
