-- Steering a change (docs/operations.md): what an operator's hand leaves on a plan, so that it
-- holds across a handover and a takeover.
ALTER TABLE plans
    ADD COLUMN hold         jsonb,        -- a held plan's catalog change, made when approved
    ADD COLUMN cancel       text,         -- why it is (being) cancelled: by whom, or superseded
    ADD COLUMN soak_tier    integer,      -- the tier of the soak in progress, or last passed
    ADD COLUMN soak_until   timestamptz,  -- when the soak in progress ends (null: passed)
    ADD COLUMN paused_after integer;      -- the last tier after which the plan paused itself

-- Held and paused plans are open too (not done): the planner and `expected` look for them.
DROP INDEX plans_open;
CREATE INDEX plans_open ON plans (id)
    WHERE state IN ('pending', 'building', 'held', 'rolling', 'paused');
