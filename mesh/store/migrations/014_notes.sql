-- A push's change note (`mesh push --note TEXT`): kept with the version it pushed (`mesh history`)
-- and with the plan that rolls it out (`mesh plan`, the console).
ALTER TABLE module_versions ADD COLUMN note text NOT NULL DEFAULT '';
ALTER TABLE plans ADD COLUMN note text NOT NULL DEFAULT '';
