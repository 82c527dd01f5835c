"""A mesh's folder on this machine: where its NATS server's configuration, its credentials and
its state live. `mesh dev up` makes one (default `.mesh/dev`); `mesh machine add/remove` work on
one; `mesh init` is meant to make one the same way.

    DIR/creds/users.json     every identity's public key, kind and role (no secrets)
    DIR/creds/admin.creds    an operator's credentials (viewer.creds likewise), mode 0600
    DIR/creds/controller.creds
    DIR/creds/hosts/NAME.creds
    DIR/nats/nats.conf       the server's configuration; it includes auth.conf
    DIR/nats/auth.conf       the authorization block, written from users.json
    DIR/nats/nats.pid        the running server's pid (written by nats-server), for reloads
    DIR/nats/url             the URL clients use
    DIR/env                  shell lines for other terminals (MESH_NATS_URL, MESH_CREDS, ...)
"""

from pathlib import Path

DEFAULT_DIR = Path(".mesh/dev")


class MeshDir:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    @property
    def creds(self) -> Path:
        return self.root / "creds"

    @property
    def users(self) -> Path:
        return self.creds / "users.json"

    @property
    def nats(self) -> Path:
        return self.root / "nats"

    @property
    def nats_conf(self) -> Path:
        return self.nats / "nats.conf"

    @property
    def auth_conf(self) -> Path:
        return self.nats / "auth.conf"

    @property
    def pid_file(self) -> Path:
        return self.nats / "nats.pid"

    @property
    def url_file(self) -> Path:
        return self.nats / "url"

    @property
    def env(self) -> Path:
        return self.root / "env"

    def creds_file(self, kind: str, name: str) -> Path:
        if kind == "host":
            return self.creds / "hosts" / f"{name}.creds"
        return self.creds / f"{name}.creds"  # admin.creds, viewer.creds, controller.creds

    def nats_url(self) -> str | None:
        try:
            return self.url_file.read_text().strip() or None
        except OSError:
            return None
