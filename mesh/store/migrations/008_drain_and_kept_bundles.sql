-- A drained machine is skipped by every plan and keeps what it runs (`mesh drain`, `mesh
-- undrain`): the operator's, like its tier, and kept across takeovers with the machine.
ALTER TABLE machines ADD COLUMN drained boolean NOT NULL DEFAULT false;

-- When the holder deleted this version's bundles and source from the bundle store (it keeps
-- those of each module's newest versions, services/controller/bundles.py); NULL while they
-- are kept. A push of the same version stores them again and clears it.
ALTER TABLE module_versions ADD COLUMN bundles_pruned timestamptz;

-- A module's history reads its plans by subject, and a new holder reads each drained machine's
-- newest step (what the catalog wants it to have) by machine: neither reads the whole table.
CREATE INDEX plans_by_subject ON plans (subject, id);
CREATE INDEX plan_steps_by_machine ON plan_steps (machine, plan_id);
