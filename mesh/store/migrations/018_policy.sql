-- The mesh's policy (`mesh policy`): how many distinct operators, none of them its author,
-- approve a held plan before it runs (the two-person rule at 2). One row; held across takeovers.
CREATE TABLE policy (
    only_row  boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    approvals integer NOT NULL DEFAULT 1 CHECK (approvals BETWEEN 1 AND 9),
    set_by    text,
    set_at    timestamptz
);
INSERT INTO policy DEFAULT VALUES;
