-- Stageline store, PostgreSQL, version 12: statements and tables that hold a steady load for hours
-- (issue 22).
--
-- claim_lane_heads probes a lane's held rows in two branches: an equality on the lane key (the
-- held-lane index, NOT NULL lanes) and one for the NULL lane, which gets its own small index here
-- so that branch is a seek too, not a walk over every earlier row.
CREATE INDEX IF NOT EXISTS stage_inbound_held_null_lane  ON stage_inbound (id)  WHERE status IN ('in_flight', 'error') AND lane_key IS NULL;
CREATE INDEX IF NOT EXISTS stage_routed_held_null_lane   ON stage_routed (id)   WHERE status IN ('in_flight', 'error') AND lane_key IS NULL;
CREATE INDEX IF NOT EXISTS stage_outbound_held_null_lane ON stage_outbound (id) WHERE status IN ('in_flight', 'error') AND lane_key IS NULL;

-- Autovacuum for churn. Every claim and finish writes a new version of a state row (never HOT:
-- the status is in the partial indexes' predicates), so a staged table at 200 msg/s leaves
-- ~1,000 dead tuples a second across the three. The default trigger (20% of the table dead)
-- waits longer and longer as history grows, and the partial claim indexes fill with dead entries
-- the claim walks over. A fixed threshold keeps each vacuum small and frequent whatever the size;
-- no cost delay, because the hot tables' dead rows are what the claim reads past.
ALTER TABLE stage_inbound  SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
                                autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0,
                                autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 20000);
ALTER TABLE stage_routed   SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
                                autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0,
                                autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 20000);
ALTER TABLE stage_outbound SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
                                autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0,
                                autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 20000);
-- Insert-mostly, and purged by retention: vacuumed after a fixed number of inserts or deletes so the
-- visibility map stays current (index-only scans) and purged space is reused, not appended.
ALTER TABLE message_events SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 20000,
                                autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 50000,
                                autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE inbound_bodies  SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000);
ALTER TABLE outbound_bodies SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000);
-- Scratch tables: every row is deleted within a run; tiny state tables renewed every heartbeat.
ALTER TABLE landing_routed   SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 2000);
ALTER TABLE landing_outbound SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 2000);
ALTER TABLE stage_batches    SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE leader_lease     SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 200);
ALTER TABLE nodes            SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 200);
