"""The NATS system account's one user: the seat's kicker (docs/security.md).

A controller that takes the seat from a holder cut off from the bus asks nats-server to close
that holder's connection at once (`$SYS.REQ.SERVER.<server id>.KICK`, nats-server 2.10+):
until the server's own pings drop it (20-30 s), its queue subscriptions keep taking requests
that vanish. That request needs a user of the system account, and the system account can see
and do everything on the bus, so this user may publish on the KICK subjects alone (and
subscribe to its inbox for the answers): it cannot read a message, list connections or change
the servers. Only the controllers get its credentials file, never a host or an operator.

On a mesh's own servers the kicker is a user JWT of the system account (mesh/auth/trust.py,
`Registry.system_user`); this module's configuration lines and seed file are for a server
without the mesh's operator (the test suite's networks of plain servers).
"""

import json
from pathlib import Path

from mesh.auth import creds
from mesh.auth.keys import new_user, public_of

ACCOUNT = "SYS"
KICK = "$SYS.REQ.SERVER.*.KICK"  # the one subject the kicker may publish on
INBOX = "_INBOX_mesh_system"  # where its answers come (its credentials file names it)
WHO = "the seat's kicker (NATS system account)"


def config_lines(public: str) -> list[str]:
    """nats-server configuration: the system account, its one user `public`, scoped to KICK."""
    q = json.dumps
    return [
        "accounts {",
        f"  {ACCOUNT} {{",
        "    users = [",
        f"      {{ nkey: {q(public)}, permissions: {{ publish: {{ allow: [{q(KICK)}] }}, "
        f"subscribe: {{ allow: [{q(INBOX + '.>')}] }} }} }}",
        "    ]",
        "  }",
        "}",
        f"system_account: {ACCOUNT}",
    ]


def ensure(path: Path, *, ca: str | None = None, servers: str | None = None) -> str:
    """The kicker's credentials file at `path` (made, mode 0600, if missing); its public key."""
    if path.exists():
        seed = creds.read(path).seed
        assert seed is not None  # ours: a seed file, never a JWT
        return public_of(seed)
    key = new_user()
    creds.write(path, who=WHO, seed=key.seed, inbox=INBOX, ca=ca, servers=servers)
    return key.public
