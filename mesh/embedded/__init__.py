"""The embedded default's plumbing: the real nats-server and PostgreSQL from their wheels, free
ports, and child processes that never outlive their parent. `mesh dev up`, `mesh init` and the
tests start servers with it."""
