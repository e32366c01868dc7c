-- Stageline store, PostgreSQL, version 15: what each node could not bind (issue 24).
--
-- A leader that cannot bind an inbound past its grace hands the lease over only when a live node
-- might do better. Each node's heartbeat now publishes the inbound names it could not bind when it
-- last led (cleared once it binds them, forgotten after a while), so the leader asks the store
-- rather than guessing from its own history: a peer that restarted, or never tried, counts as able.
ALTER TABLE nodes ADD COLUMN cannot_bind text;
