-- What a scoped operator may ask for beyond its modules' own accounts (mesh/auth/scopes.py):
-- an admin's grants, as `mesh operator add --allow` words (root, groups:LIST, secrets:GLOB,
-- accounts:LIST). And who may use a secret: the modules its glob matches (`mesh secret set
-- --modules GLOB`) and the operator that set it. Columns with defaults: a controller of the
-- version before reads and writes these tables as it did.
ALTER TABLE operators ADD COLUMN allow text[] NOT NULL DEFAULT '{}';
ALTER TABLE secrets
    ADD COLUMN modules text,  -- NULL: only admins' modules (and the operator that set it)
    ADD COLUMN set_by text NOT NULL DEFAULT '';
