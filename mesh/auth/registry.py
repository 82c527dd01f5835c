"""A mesh's identities, kept in its folder (`mesh.meshdir`): issuing one writes its credentials
file (0600: its JWT, signed by the mesh's signer, and its seed); revoking one deletes the file
and puts its key in the account's revocations (`mesh.auth.trust`), which the servers are given
(`server.write`, and `server.publish_account` to those running). Public keys and revocations live
in `creds/users.json`; each seed lives only in its own credentials file."""

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from mesh.auth import claims, creds, server
from mesh.auth.keys import new_user, public_of
from mesh.auth.policy import Kind, Role, User, inbox
from mesh.auth.trust import CLAIMS_INBOX, KICKER_INBOX, Revoked, Trust
from mesh.errors import MeshError
from mesh.meshdir import MeshDir
from mesh.names import check_name

CONTROLLER = "controller"  # the one identity every controller instance uses


class AuthError(MeshError):
    """A failure of issuing or revoking credentials; the message says what to do."""


class _Users(msgspec.Struct, omit_defaults=True):
    users: list[User] = []
    revoked: list[Revoked] = []  # keys the account refuses (removed, or issued anew)


class Registry:
    def __init__(self, folder: MeshDir) -> None:
        self.dir = folder
        self.users: dict[tuple[str, str], User] = {}
        self.revoked: dict[str, Revoked] = {}
        self._trust: Trust | None = None

    @property
    def trust(self) -> Trust:
        """The folder's keys (made on first use: a folder from before JWTs gets them)."""
        if self._trust is None:
            self._trust = Trust.of(self.dir.nats_keys)
        return self._trust

    @classmethod
    def load(cls, folder: MeshDir) -> "Registry":
        registry = cls(folder)
        try:
            data = folder.users.read_bytes()
        except FileNotFoundError:
            return registry
        except OSError as e:
            raise AuthError(f"{folder.users}: {e.strerror or e}") from None
        try:
            loaded = msgspec.json.decode(data, type=_Users)
        except msgspec.DecodeError as e:
            raise AuthError(f"{folder.users}: {e}") from None
        registry.users = {(u.kind, u.name): u for u in loaded.users}
        registry.revoked = {r.public: r for r in loaded.revoked}
        return registry

    def get(self, kind: Kind, name: str) -> User | None:
        return self.users.get((kind, name))

    def issue(
        self, kind: Kind, name: str, *, role: Role | None = None, builder: bool = False,
        modules: str | None = None,
    ) -> Path:  # fmt: skip
        """New keys for `name` (replacing any it had: its old file stops working at the next
        reload). Returns the credentials file's path. Call `save` to make it count."""
        check_name(name, field="name")
        if kind != "host" and (kind == "controller") != (name == CONTROLLER):
            # their files sit side by side: creds/<name>.creds
            raise AuthError(f"{name}: only the controllers' identity is called {CONTROLLER!r}")
        key = new_user()
        user = User(name=name, kind=kind, public=key.public, role=role, builder=builder,
                    modules=modules)  # fmt: skip
        path = self.dir.creds_file(kind, name)
        self._write(path, user, key.seed)
        before = self.users.get((kind, name))
        if before is not None and before.public != key.public:
            self.revoke_key(before.public)  # its old file, and its JWT, stop working
        self.users[(kind, name)] = user
        return path

    def revoke_key(self, public: str) -> None:
        """Refuse `public` from now on (a removed identity, or a machine that joined with a
        token, whose key this folder never issued): JWTs issued at or before this second are
        refused; a new key is issued, never a new JWT for a revoked key (same second)."""
        self.revoked[public] = Revoked(public=public, at=int(time.time()))

    def _write(self, path: Path, user: User, seed: str) -> None:
        """The credentials file, carrying the mesh's CA and NATS URL(s) where the folder has
        them: the one file a machine needs to connect; a host's also names the controllers'
        public key, which it checks what they sign with (mesh.auth.signing)."""
        try:
            ca = self.dir.ca.read_text()
        except FileNotFoundError:
            ca = None
        creds.write(path, who=user.describe(), seed=seed, inbox=inbox(user), ca=ca,
                    servers=self.dir.nats_url(), jwt=self.trust.user_jwt(user),
                    controller=self._controller_key() if user.kind == "host" else None,
                    operator=user.name if user.kind == "operator" else None)  # fmt: skip

    def _signed_here(self, held: creds.Creds) -> bool:
        """Whether a file's JWT was signed by this folder's signer (a file from before JWTs,
        or of keys made anew, is written again with the same seed)."""
        if held.user_jwt is None:
            return False
        try:
            return claims.decode(held.user_jwt).get("iss") == self.trust.signer.public
        except claims.ClaimsError:
            return False

    def _controller_key(self) -> str | None:
        controller = self.get("controller", CONTROLLER)
        return controller.public if controller is not None else None

    def _refresh_hosts(self) -> None:
        """Hosts' files that name another controllers' key than the folder's (issued before
        the controllers' identity was, or before it was issued anew) are written again, with
        the same key of their own."""
        key = self._controller_key()
        if key is None:
            return
        for user in self.users.values():
            if user.kind != "host":
                continue
            path = self.dir.creds_file("host", user.name)
            try:
                held = creds.read(path)
            except creds.CredsError:
                continue  # a missing or broken file is issued again by `ensure`, not here
            if (
                held.seed
                and public_of(held.seed) == user.public
                and (held.controller != key or not self._signed_here(held))
            ):
                self._write(path, user, held.seed)

    def ensure(
        self, kind: Kind, name: str, *, role: Role | None = None, builder: bool = False
    ) -> Path:
        """The credentials of `name`, issued only if it has none that still match its file (so a
        mesh started again on the same folder keeps its credentials). A changed role or builder
        flag is a new key, the old one revoked: a JWT carries its permissions, so the old one
        would keep the old ones."""
        path = self.dir.creds_file(kind, name)
        user = self.get(kind, name)
        if user is not None and (user.role, user.builder) == (role, builder):
            try:
                held = creds.read(path)
            except creds.CredsError:
                held = None
            if held is not None and held.seed and public_of(held.seed) == user.public:
                if (
                    (self.dir.ca.exists() and held.ca != self.dir.ca.read_text())
                    or (kind == "operator" and held.operator != name)
                    or not self._signed_here(held)
                ):  # the same key, with the mesh's CA, its operator's name, a JWT of ours
                    self._write(path, user, held.seed)
                return path
        return self.issue(kind, name, role=role, builder=builder)

    def system_user(self, which: str) -> Path:
        """A user of the system account, its file `creds/<which>.creds` kept with its key:
        `system`, the seat's kicker (the controllers'), or `claims`, which pushes the account's
        JWT to the servers (this folder's alone)."""
        path = self.dir.creds / f"{which}.creds"
        try:
            seed = creds.read(path).seed
        except creds.CredsError:
            seed = None
        key = claims.key_of(seed) if seed else claims.new_key("user")
        if which == "system":
            jwt, box, who = self.trust.kicker_jwt(key.public), KICKER_INBOX, "the seat's kicker"
        else:
            jwt, box, who = self.trust.claims_jwt(key.public), CLAIMS_INBOX, "the claims pusher"
        try:
            ca = self.dir.ca.read_text()
        except FileNotFoundError:
            ca = None
        creds.write(path, who=f"{who} (NATS system account)", seed=key.seed, inbox=box, ca=ca,
                    servers=self.dir.nats_url(), jwt=jwt)  # fmt: skip
        return path

    def revoke(self, kind: Kind, name: str) -> Path:
        user = self.users.pop((kind, name), None)
        if user is None:
            raise AuthError(f"no {kind} {name} in {self.dir.users}")
        self.revoke_key(user.public)
        path = self.dir.creds_file(kind, name)
        path.unlink(missing_ok=True)
        return path

    def save(self) -> None:
        """Write users.json and what the servers are given (and hosts' files whose controllers'
        key is not the folder's)."""
        self._refresh_hosts()
        self.dir.creds.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir.creds, 0o700)
        body = msgspec.json.format(
            msgspec.json.encode(
                _Users(
                    users=sorted(self.users.values(), key=lambda u: (u.kind, u.name)),
                    revoked=sorted(self.revoked.values(), key=lambda r: r.public),
                )
            )
        )
        tmp = self.dir.users.with_name(".users.json.tmp")
        tmp.write_bytes(body + b"\n")
        tmp.replace(self.dir.users)
        self.dir.nats.mkdir(parents=True, exist_ok=True)
        server.write(self.dir.auth_conf, self.trust, list(self.revoked.values()))


@contextmanager
def locked(folder: MeshDir) -> Iterator[Registry]:
    """The registry of `folder`, loaded under an exclusive lock (two `mesh machine add` at once
    must not lose one of them), saved by the caller."""
    folder.creds.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(folder.creds / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield Registry.load(folder)
    finally:
        os.close(fd)
