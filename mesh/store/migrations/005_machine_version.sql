-- Which mesh each machine's host agent runs (mesh/version.py): `sha256:<hex>` for a mesh
-- bundle, `installed` for the mesh installed on the machine; NULL until an agent that says it
-- registers. Taken at each registration, as the facts are.
ALTER TABLE machines ADD COLUMN version text;
