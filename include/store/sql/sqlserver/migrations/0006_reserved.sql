-- Version 6 is reserved for the HL7 batches migration, written on another branch at the same time
-- as version 7. This placeholder keeps the versions gap-free on this branch and does nothing;
-- the batches branch's 0006 replaces it when the two meet (delete this file then).
SELECT 1;
