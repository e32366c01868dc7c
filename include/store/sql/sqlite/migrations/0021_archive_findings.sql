-- Stageline store, SQLite, version 21: retention's archive keeps what version 19 and 20 added to a
-- staged message — its conformance findings and its format — so an archived message reads like a
-- hot one (`messages show`, the API) and a replay of a FHIR message is still routed as FHIR.
ALTER TABLE archive_inbound ADD COLUMN findings TEXT;
ALTER TABLE archive_inbound ADD COLUMN format TEXT;
