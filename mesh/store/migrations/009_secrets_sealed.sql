-- Secrets encrypted at rest (mesh/auth/secretkeys.py): each value sealed under a data key of its
-- own, the data key wrapped by the mesh's key-encryption key, which never enters the store (a
-- file of the controllers'). `key_id` names that key; a row with neither is a value stored in
-- plaintext by an older mesh, which the next holder seals at its takeover (a migration cannot:
-- it has no key).
ALTER TABLE secrets
    ADD COLUMN data_key bytea,
    ADD COLUMN key_id   text,
    ADD CONSTRAINT secrets_sealed_whole CHECK ((data_key IS NULL) = (key_id IS NULL));

-- The key as the store knows it: which one wraps the secrets (its id, never the key) and its
-- generation, raised at each rotation: the version of `mesh-secrets-key`, the file the
-- controllers' module is given (services/controller/module.toml).
CREATE TABLE secrets_key (
    only_row   boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    key_id     text NOT NULL,
    version    integer NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now()
);
