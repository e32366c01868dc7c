-- Stageline store, SQL Server (T-SQL), version 17: the inbound rows by received time (issue 26;
-- postgres/migrations/0017_received_index.sql says why). No BRIN here: a b-tree.
CREATE INDEX stage_inbound_created ON stage_inbound (created_at);
