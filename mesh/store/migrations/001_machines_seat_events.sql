-- Machines the mesh knows, the seat with its epoch, and an event log.
CREATE TABLE machines (
    name          text PRIMARY KEY,
    tier          integer NOT NULL DEFAULT 2,
    labels        jsonb NOT NULL DEFAULT '{}'::jsonb,
    facts         jsonb,
    up            boolean NOT NULL DEFAULT false,
    last_seen     timestamptz,
    beat_interval double precision NOT NULL DEFAULT 1,
    registered_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE seats (
    name   text PRIMARY KEY,
    epoch  bigint NOT NULL DEFAULT 0,
    holder text,
    pid    integer,
    host   text,
    since  timestamptz
);
INSERT INTO seats (name) VALUES ('mesh-controller');

CREATE TABLE events (
    id      bigserial PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    kind    text NOT NULL,
    machine text,
    epoch   bigint,
    detail  jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX events_by_machine ON events (machine, id);
