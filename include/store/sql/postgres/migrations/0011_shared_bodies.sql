-- Stageline store, PostgreSQL, version 11: a pass-through row's body is written once.
--
-- An outbound row for a destination with nothing to compute (no rules, no hook, one lane) is the
-- message as received: it gets no outbound_bodies row of its own, and its body is its inbound
-- row's. This view is the one place that says which body a row has: the deliver read, `messages
-- show` and the archive copy read it (purge_finished_inbound keeps the inbound body while the row
-- is there). Rows staged before this version keep the copy they have, which is read first.
DROP VIEW outbound_messages;
CREATE VIEW outbound_messages AS
SELECT o.*, COALESCE(b.payload, (SELECT i.payload FROM inbound_bodies i WHERE i.id = o.source_id)) AS payload
  FROM stage_outbound o LEFT JOIN outbound_bodies b ON b.id = o.id;
