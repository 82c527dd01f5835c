"""A mesh's folder on this machine: where its NATS server's configuration, its credentials and
its state live. `mesh dev up` makes one (default `.mesh/dev`); `mesh machine add/remove` work on
one; `mesh init` is meant to make one the same way.

    DIR/creds/users.json     every identity's public key, kind and role (no secrets)
    DIR/creds/admin.creds    an operator's credentials (viewer.creds likewise), mode 0600
    DIR/creds/controller.creds
    DIR/creds/hosts/NAME.creds
    DIR/creds/store/ROLE.password  the embedded PostgreSQL's passwords (postgres, mesh,
                             replicator), mode 0600
    DIR/keys/secrets.key     the key of the secrets in the store (mesh/auth/secretkeys.py), mode
                             0600 in a 0700 folder: back it up
    DIR/keys/nats/*.nk       the NATS operator's, accounts' and signing key's seeds
                             (mesh/auth/trust.py), mode 0600: back them up
    DIR/tls/ca.pem           the mesh's CA certificate, given to every client (MESH_CA)
    DIR/tls/ca.key           its key, mode 0600: it signs the servers' certificates
    DIR/nats/auth.conf       the operator and accounts' JWTs every server includes, written from
                             the keys and users.json
    DIR/nats/nK/nats.conf    server nK's configuration (n1, n2, ...); it includes auth.conf
    DIR/nats/nK/server.pem   its certificate (server.key, mode 0600), signed by the CA
    DIR/nats/nK/nats.pid     the running server's pid (written by nats-server), for reloads
    DIR/nats/nK/js           its JetStream store
    DIR/nats/url             the URL(s) clients use, comma-separated
    DIR/env                  shell lines for other terminals (MESH_NATS_URL, MESH_CA, MESH_DIR,
                             MESH_CREDS, MESH_DATABASE_URL with its password), mode 0600
"""

import os
from pathlib import Path

# MESH_DIR (DIR/env sets it) lets `mesh machine add` and `mesh cert` find the mesh from any folder.
DEFAULT_DIR = Path(os.environ.get("MESH_DIR") or ".mesh/dev")


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
    def store_passwords(self) -> Path:
        """The embedded PostgreSQL's passwords, a file per role (`mesh.embedded.pgauth`)."""
        return self.creds / "store"

    @property
    def secrets_key(self) -> Path:
        """The key of the secrets in the store (`mesh.auth.secretkeys`)."""
        return self.root / "keys" / "secrets.key"

    @property
    def nats_keys(self) -> Path:
        """The NATS operator's, accounts' and signing key's seeds (`mesh.auth.trust`)."""
        return self.root / "keys" / "nats"

    @property
    def nats_signer(self) -> Path:
        """The signing key every identity's JWT is signed by (the controllers' too)."""
        return self.nats_keys / "signer.nk"

    @property
    def nats(self) -> Path:
        return self.root / "nats"

    @property
    def tls(self) -> Path:
        return self.root / "tls"

    @property
    def ca(self) -> Path:
        return self.tls / "ca.pem"

    @property
    def auth_conf(self) -> Path:
        return self.nats / "auth.conf"

    def server(self, name: str) -> Path:
        """The folder of nats-server `name` (n1, n2, ...)."""
        return self.nats / name

    def server_cert(self, name: str) -> Path:
        return self.server(name) / "server.pem"

    def server_key(self, name: str) -> Path:
        return self.server(name) / "server.key"

    def servers(self) -> list[str]:
        """The names of the nats-servers this folder has configured, in order."""
        found = [p.parent.name for p in self.nats.glob("n*/nats.conf")]
        return sorted(found, key=lambda n: (len(n), n))

    def pid_files(self) -> list[Path]:
        """Where each of this folder's nats-servers writes its pid."""
        return [self.server(n) / "nats.pid" for n in self.servers()]

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
