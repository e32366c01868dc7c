-- Stageline store, PostgreSQL, version 17: the inbound rows by received time (issue 26).
--
-- A content search (`stageline messages find --contains/--where`) reads the bodies of one time
-- window. Without an index on created_at it read stage_inbound from its newest row back to the
-- window. BRIN: rows are appended in time order, so a block range summary is exact enough and costs
-- the ingest next to nothing (a b-tree would be an entry per message). The trigram index on the
-- bodies is the operator's choice (`stageline messages content-index`), not a migration: it costs
-- every ingest (docs/operations.md, docs/performance.md).
CREATE INDEX stage_inbound_created ON stage_inbound USING brin (created_at);
