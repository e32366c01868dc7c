-- Stageline store, SQLite, version 20: what a staged body is, as the inbound that took it decided
-- (issue 27). NULL for HL7 v2 (and any text a non-FHIR inbound takes); 'fhir' for a body the FHIR
-- inbound validated (listeners/fhir_inbound.py). The route stage's `fhir` conditions read only
-- rows marked 'fhir', never a body that merely looks like JSON. Written with the row, never changed.
ALTER TABLE stage_inbound ADD COLUMN format TEXT;
