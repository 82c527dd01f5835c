"""A mesh's identities, kept in its folder (`mesh.meshdir`): issuing one writes its credentials
file (0600) and the server's authorization block; revoking one removes both. Public keys live in
`creds/users.json`; each seed lives only in its own credentials file."""

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from mesh.auth import creds, server
from mesh.auth.keys import new_user, public_of
from mesh.auth.policy import Kind, Role, User, inbox
from mesh.errors import MeshError
from mesh.meshdir import MeshDir
from mesh.names import check_name

CONTROLLER = "controller"  # the one identity every controller instance uses


class AuthError(MeshError):
    """A failure of issuing or revoking credentials; the message says what to do."""


class _Users(msgspec.Struct):
    users: list[User] = []


class Registry:
    def __init__(self, folder: MeshDir) -> None:
        self.dir = folder
        self.users: dict[tuple[str, str], User] = {}

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
            users = msgspec.json.decode(data, type=_Users).users
        except msgspec.DecodeError as e:
            raise AuthError(f"{folder.users}: {e}") from None
        registry.users = {(u.kind, u.name): u for u in users}
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
        self.users[(kind, name)] = user
        return path

    def _write(self, path: Path, user: User, seed: str) -> None:
        """The credentials file, carrying the mesh's CA and NATS URL(s) where the folder has
        them: the one file a machine needs to connect; a host's also names the controllers'
        public key, which it checks what they sign with (mesh.auth.signing)."""
        try:
            ca = self.dir.ca.read_text()
        except FileNotFoundError:
            ca = None
        creds.write(path, who=user.describe(), seed=seed, inbox=inbox(user), ca=ca,
                    servers=self.dir.nats_url(),
                    controller=self._controller_key() if user.kind == "host" else None,
                    operator=user.name if user.kind == "operator" else None)  # fmt: skip

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
            if held.seed and held.controller != key and public_of(held.seed) == user.public:
                self._write(path, user, held.seed)

    def ensure(
        self, kind: Kind, name: str, *, role: Role | None = None, builder: bool = False
    ) -> Path:
        """The credentials of `name`, issued only if it has none that still match its file (so a
        mesh started again on the same folder keeps its credentials). A changed role or builder
        flag keeps the key: only the permissions change."""
        path = self.dir.creds_file(kind, name)
        user = self.get(kind, name)
        if user is not None:
            try:
                held = creds.read(path)
            except creds.CredsError:
                held = None
            if held is not None and held.seed and public_of(held.seed) == user.public:
                user = msgspec.structs.replace(user, role=role, builder=builder)
                self.users[(kind, name)] = user
                if self.dir.ca.exists() and held.ca != self.dir.ca.read_text():
                    self._write(path, user, held.seed)  # the same key, now with the mesh's CA
                elif kind == "operator" and held.operator != name:
                    self._write(path, user, held.seed)  # the same key, now naming its operator
                return path
        return self.issue(kind, name, role=role, builder=builder)

    def revoke(self, kind: Kind, name: str) -> Path:
        if self.users.pop((kind, name), None) is None:
            raise AuthError(f"no {kind} {name} in {self.dir.users}")
        path = self.dir.creds_file(kind, name)
        path.unlink(missing_ok=True)
        return path

    def save(self) -> None:
        """Write users.json and the server's authorization block (and hosts' files whose
        controllers' key is not the folder's)."""
        self._refresh_hosts()
        self.dir.creds.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir.creds, 0o700)
        body = msgspec.json.format(
            msgspec.json.encode(
                _Users(users=sorted(self.users.values(), key=lambda u: (u.kind, u.name)))
            )
        )
        tmp = self.dir.users.with_name(".users.json.tmp")
        tmp.write_bytes(body + b"\n")
        tmp.replace(self.dir.users)
        self.dir.nats.mkdir(parents=True, exist_ok=True)
        server.write(self.dir.auth_conf, self.users.values())


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
