"""A nemesis run's history: one JSON object a line, written as things happen, each with `t`,
the seconds since the run started (time.monotonic(), so that a clock step changes nothing).

Kinds of lines (`type`):
- `fault`: `phase` start or end, `id`, `kind`, `target` (resolved: `ctl-1`, `n2`, `pg1`);
- `op`: a client's operation, `phase` invoke, then ok, fail or timeout, with `id`, `op`
  (status, push, assign, secret, handover), what it asked and what it was told;
- `epoch`: an epoch seen, `source` status (a holder's answer), bus (the `mesh-seat` record),
  declared (a declaration put on the bus, with `machine`), applied (a host's `applied` event,
  with `machine`, `digest`, `ok`);
- `note`: what the harness did beside the faults (a controller restarted by its supervisor);
- `exit`: a piece stopped with SIGTERM at the end, `seconds` until it exited (None: it did not);
- `final`: the store as read at the end (what the checker compares the acknowledgements with).
"""

import json
import time
from pathlib import Path
from typing import Any, TextIO


class History:
    """Appends lines to a file (flushed: a run stopped half-way leaves what it saw) and keeps
    them for the checker."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self.lines: list[dict[str, Any]] = []
        self._file: TextIO = path.open("w")
        self._ids = 0

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def add(self, type_: str, **fields: Any) -> dict[str, Any]:
        line = {"t": self.now(), "type": type_, **fields}
        self.lines.append(line)
        self._file.write(json.dumps(line, default=str) + "\n")
        self._file.flush()
        return line

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def close(self) -> None:
        self._file.close()


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
