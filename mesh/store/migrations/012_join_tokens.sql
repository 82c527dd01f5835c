-- Join tokens (`mesh token create`; `mesh join` redeems them): what a new machine presents to
-- join the mesh, with the tier, labels and site it is given. Only the SHA-256 of a token's
-- secret is kept: whoever reads this table (a backup, a replica) cannot join with it. A use
-- locks the row (services/controller/tokens.py, redeem), so two machines racing for a token's
-- last use get one use between them.
CREATE TABLE join_tokens (
    seq bigserial PRIMARY KEY,  -- the order they were made in: `token list`'s pages
    id text NOT NULL UNIQUE CHECK (id ~ '^[0-9a-f]{12}$'),
    secret_sha256 bytea NOT NULL CHECK (octet_length(secret_sha256) = 32),
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,  -- the operator the mesh verified
    expires_at timestamptz NOT NULL,
    uses_left integer NOT NULL CHECK (uses_left >= 0),
    revoked_at timestamptz,
    revoked_by text,
    tier integer NOT NULL CHECK (tier BETWEEN 0 AND 9),
    labels jsonb NOT NULL DEFAULT '{}'::jsonb,  -- role=control included for a control machine
    control boolean NOT NULL DEFAULT false,
    site text,
    used_by text[] NOT NULL DEFAULT '{}'  -- the machines that joined with it, in order
);
