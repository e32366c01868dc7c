-- Stageline store, SQLite, version 12: the NULL lane's held rows get an index of their own, so
-- claim_lane_heads' NULL branch is a seek, not a walk over every earlier row
-- (postgres/migrations/0012_steady_load.sql says why).
CREATE INDEX IF NOT EXISTS stage_inbound_held_null_lane  ON stage_inbound (id)  WHERE status IN ('in_flight', 'error') AND lane_key IS NULL;
CREATE INDEX IF NOT EXISTS stage_routed_held_null_lane   ON stage_routed (id)   WHERE status IN ('in_flight', 'error') AND lane_key IS NULL;
CREATE INDEX IF NOT EXISTS stage_outbound_held_null_lane ON stage_outbound (id) WHERE status IN ('in_flight', 'error') AND lane_key IS NULL;
