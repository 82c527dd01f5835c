-- Modules with their version history, assignments, secrets, declarations, builds and plans.
CREATE TABLE module_versions (
    id         bigserial PRIMARY KEY,
    module     text NOT NULL,
    version    text NOT NULL,           -- digest of the module's source archive
    manifest   text NOT NULL,           -- module.toml as pushed
    bundles    jsonb NOT NULL,          -- bundle name -> digest
    pushed_at  timestamptz NOT NULL DEFAULT now(),
    pushed_by  text NOT NULL DEFAULT '',
    UNIQUE (module, version)
);

CREATE TABLE modules (
    name       text PRIMARY KEY,
    version_id bigint NOT NULL REFERENCES module_versions (id),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE assignments (
    module  text NOT NULL REFERENCES modules (name),
    machine text NOT NULL REFERENCES machines (name),
    PRIMARY KEY (module, machine)
);

CREATE TABLE secrets (
    name       text PRIMARY KEY,
    value      bytea NOT NULL,
    version    integer NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE declarations (
    machine    text PRIMARY KEY REFERENCES machines (name),
    digest     text NOT NULL,
    body       bytea NOT NULL,          -- canonical JSON
    epoch      bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE builds (
    key        text PRIMARY KEY,        -- sha256 of source digest + bundle + argv + output
    module     text NOT NULL,
    bundle     text NOT NULL,
    source     text NOT NULL,
    builder    text,
    state      text NOT NULL,           -- running | done | failed
    digest     text,
    log_tail   text NOT NULL DEFAULT '',
    log_object text,
    started    timestamptz NOT NULL DEFAULT now(),
    finished   timestamptz
);

CREATE TABLE plans (
    id        bigserial PRIMARY KEY,
    trigger   text NOT NULL,            -- push | assign | unassign | secret
    subject   text NOT NULL,            -- the module or secret it is about
    state     text NOT NULL,
    epoch     bigint NOT NULL,
    machines  jsonb NOT NULL,           -- machine -> {"before": digest, "after": digest}
    created   timestamptz NOT NULL DEFAULT now()
);
