-- Stageline store, SQLite, version 19: a flagging conformance profile's findings (issue 27).
-- NULL for a message that conforms or was not checked; else the JSON array of its findings
-- ({code, where, text}: table 0357 code, ERL, the rule broken), written with the row at ingest and
-- never changed (docs/profiles.md). The route stage reads it for `when = { findings = … }`.
ALTER TABLE stage_inbound ADD COLUMN findings TEXT;
