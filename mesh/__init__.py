"""mesh: a fleet controller on a NATS bus, with PostgreSQL as its truth.

`mesh/` is the plumbing and the pure logic (names, wire model, bus, store, the embedded dev cluster,
the command line); the behaviour lives in `services/` (controller, host) and depends on `mesh/`,
never the reverse.
"""

__version__ = "0.1.0"
