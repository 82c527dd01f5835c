-- A secret's previous version, kept beside the current one: machines a plan of its change has
-- not reached yet are served the version their declarations name, and a plan that fails puts
-- the previous one back (`secret set` rolls out with canary, soak and revert as a push does).
-- Sealed as the current one is (mesh/auth/secretkeys.py); NULL: none.
ALTER TABLE secrets
    ADD COLUMN prev_version integer,
    ADD COLUMN prev_value bytea,
    ADD COLUMN prev_data_key bytea,
    ADD COLUMN prev_key_id text;
