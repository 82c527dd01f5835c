-- Where the operator puts a machine before it has ever registered (`mesh machine add --tier
-- --label`, or `mesh tier` / `mesh label` naming it): its first registration takes this tier
-- and these labels. After that, `machines.tier` and `machines.labels` are the operator's too:
-- a registration carries facts, never the tier or labels that decide what a machine gets.
CREATE TABLE placements (
    name   text PRIMARY KEY,
    tier   integer NOT NULL DEFAULT 2,
    labels jsonb NOT NULL DEFAULT '{}'::jsonb,
    at     timestamptz NOT NULL DEFAULT now()
);
