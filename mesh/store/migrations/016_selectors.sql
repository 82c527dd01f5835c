-- Standing placements by label (`mesh assign MODULE --label K=V`, a first push's `[assign]
-- labels`): a machine that registers later, or is labelled later, gets the module through a
-- plan; one whose labels stop matching loses it. Removed with `mesh unassign MODULE --label`.
CREATE TABLE selectors (
    module  text NOT NULL REFERENCES modules (name) ON DELETE CASCADE,
    labels  jsonb NOT NULL,
    by      text NOT NULL DEFAULT '',
    created timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (module, labels)
);
