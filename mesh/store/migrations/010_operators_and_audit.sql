-- Named operators (docs/operations.md, Operators): the controller's truth of who may change
-- what. nats-server's authorization (the mesh folder's creds/users.json) decides which
-- subjects an operator may publish on; this table says what its changes may touch (a
-- deployer's glob of modules) and that it was removed. The three operators `mesh dev up` and
-- `mesh init` issue are here from the start.
CREATE TABLE operators (
    name text PRIMARY KEY,
    role text NOT NULL CHECK (role IN ('admin', 'deployer', 'viewer', 'tools')),
    modules text,  -- a deployer's glob (fnmatch); NULL: every module
    added timestamptz NOT NULL DEFAULT now(),
    added_by text NOT NULL DEFAULT '',
    removed timestamptz,  -- revoked: its changes are refused, whatever reaches the controller
    removed_by text
);
INSERT INTO operators (name, role, added_by) VALUES
    ('admin', 'admin', 'mesh'), ('viewer', 'viewer', 'mesh'), ('tools', 'tools', 'mesh');

-- The audit log: every change an operator asked for, with the operator the mesh verified
-- (the name in the subject nats-server let it publish on), written in the change's own
-- transaction; a refusal is written on its own.
CREATE TABLE audit (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    who text NOT NULL,
    verb text NOT NULL,
    subject text NOT NULL,
    outcome text NOT NULL,  -- ok, or the refusal's code (forbidden, not_found, ...)
    detail text NOT NULL DEFAULT '',  -- the plan it made, or what the refusal said
    epoch bigint
);
CREATE INDEX audit_by_who ON audit (who, id);
