"""The nemesis of issue 29: a seeded random schedule of faults on a cluster in network
namespaces while clients work, a history of what happened, and a checker of the promises
(docs/performance.md, Faults). Used by tests/test_nemesis.py and bench/nemesis.py.

- schedule.py: the faults, from a seed;
- cluster.py: the pieces in their namespaces, the supervisor, the HA manager's promotion;
- inject.py: each fault done and healed;
- workload.py: status streams, changes with the command line, what the bus says;
- history.py: the history, JSON lines;
- checker.py: the promises checked on a history (pure);
- run.py: one run, start to end.

It imports the test helpers it stands on (tests/netns.py, tests/faults.py) by their top-level
names: tests/ must be on sys.path (pytest puts it there; bench/nemesis.py does).
"""
