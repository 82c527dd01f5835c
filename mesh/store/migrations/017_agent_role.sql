-- The `agent` role (`mesh operator add NAME --role agent --modules GLOB`): it proposes the changes
-- a deployer of its glob could make, each held until a person approves it.
ALTER TABLE operators DROP CONSTRAINT operators_role_check;
ALTER TABLE operators ADD CONSTRAINT operators_role_check
    CHECK (role IN ('admin', 'deployer', 'viewer', 'tools', 'agent'));
