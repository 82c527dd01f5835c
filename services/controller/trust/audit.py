"""A change's audit writer: who asked, which verb, about what (docs/security.md, the audit log).

The verb table's guard (operators.py) makes one for each change it serves and passes it to the
method that serves the verb, which passes it on to where the change commits: `write` puts the
entry in that transaction, so no change exists without its entry. A change that wrote nothing
in a transaction of its own (`no change`, a handover) is written by the guard once answered, a
refusal on its own. Nothing is ambient: a method that changes something takes its `Audit`, and
one the controller runs on its own behalf (the planner's) takes none.
"""

from dataclasses import dataclass

import asyncpg

from mesh.store import audit

ANONYMOUS = "anonymous"  # who asked, on a bus where nobody is authenticated


@dataclass
class Audit:
    """The change being served: who, which verb, about what; `written` once its entry is."""

    who: str
    verb: str
    subject: str
    epoch: int
    written: bool = False

    async def write(
        self, conn: asyncpg.Connection, *, detail: str = "", subject: str | None = None
    ) -> None:
        """The entry, in `conn`'s transaction (that of the change itself); once."""
        if self.written:
            return
        await audit.record(conn, who=self.who, verb=self.verb, subject=subject or self.subject,
                           outcome="ok", detail=detail, epoch=self.epoch)  # fmt: skip
        self.written = True

    def on_behalf(self, verb: str, subject: str) -> "Audit":
        """A change made on behalf of this one (`operator remove --revert`'s unassigns): its
        own entry, by the same operator."""
        return Audit(who=self.who, verb=verb, subject=subject, epoch=self.epoch)
