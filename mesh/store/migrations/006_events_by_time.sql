-- Events are pruned by age (services/controller/pruning.py): the oldest found by their time.
CREATE INDEX events_by_time ON events (at);
