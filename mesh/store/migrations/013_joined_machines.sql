-- Machines that joined with a token (`mesh join`): the key the controller signed credentials
-- for, so that `mesh machine remove` can revoke it (the mesh's folder never saw it), and a
-- machine asking again after its answer was lost is recognised by its name, key and token.
CREATE TABLE joined_machines (
    name text PRIMARY KEY,
    public_key text NOT NULL CHECK (public_key ~ '^U[A-Z2-7]{55}$'),
    token_id text NOT NULL,
    tier integer NOT NULL,
    labels jsonb NOT NULL DEFAULT '{}'::jsonb,
    control boolean NOT NULL DEFAULT false,
    site text,
    joined_at timestamptz NOT NULL DEFAULT now()
);
