-- Plans roll out in tiers: one step per affected machine, each with the declaration it had
-- before and the one it gets, so a failed plan can give changed machines their old one back.
ALTER TABLE plans
    ADD COLUMN requested_by text NOT NULL DEFAULT '',
    ADD COLUMN builds       jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN settings     jsonb NOT NULL DEFAULT '{}',
    ADD COLUMN undo         jsonb NOT NULL DEFAULT '{}',   -- how to take the catalog change back
    ADD COLUMN phase        text NOT NULL DEFAULT 'forward',  -- forward | revert
    ADD COLUMN started      timestamptz,
    ADD COLUMN finished     timestamptz,
    ADD COLUMN error        text;

CREATE TABLE plan_steps (
    plan_id     bigint NOT NULL REFERENCES plans (id),
    machine     text NOT NULL REFERENCES machines (name),
    tier        integer NOT NULL,
    state       text NOT NULL DEFAULT 'pending',  -- pending|applying|done|failed|skipped|reverted
    before      text,                             -- digest the machine had when the plan started
    before_body bytea,
    after       text NOT NULL,
    after_body  bytea NOT NULL,
    published   boolean NOT NULL DEFAULT false,   -- `after` went out: a revert must undo it
    reverted    boolean NOT NULL DEFAULT false,
    epoch       bigint,                           -- the seat's epoch that last wrote the step
    started     timestamptz,
    finished    timestamptz,
    error       text,
    PRIMARY KEY (plan_id, machine)
);

-- Plans recorded before tiers existed were applied at once: keep what they changed as steps.
INSERT INTO plan_steps (plan_id, machine, tier, state, before, after, after_body, published,
                        epoch, started, finished)
SELECT p.id, m.key, coalesce(mc.tier, 2), 'done', m.value ->> 'before', m.value ->> 'after',
       '', true, p.epoch, p.created, p.created
FROM plans p
CROSS JOIN LATERAL jsonb_each(p.machines) AS m
JOIN machines mc ON mc.name = m.key;

UPDATE plans SET started = created, finished = created WHERE state = 'done';
ALTER TABLE plans DROP COLUMN machines;

CREATE INDEX plans_open ON plans (id) WHERE state IN ('pending', 'building', 'rolling');
