"""The mesh's NATS chain of trust, kept in its folder: an operator, the account every identity of
the mesh is a user of (`MESH`, with JetStream), the system account (`SYS`: the seat's kicker,
and pushing the account's JWT to the servers), and the signing key that signs users.

The servers know the operator and the two accounts' JWTs (the `auth.conf` every server's
configuration includes, with the built-in `full` resolver, which keeps the accounts' JWTs and
spreads a new one across the cluster); they know no user. A user is admitted by its JWT alone,
signed by the signing key, so issuing one changes no server; revoking one is a new account JWT
with its key in the revocations, pushed to the servers (`$SYS.REQ.CLAIMS.UPDATE`), which close
its connections at once (docs/security.md, identities).

    DIR/keys/nats/operator.nk   the operator's seed: signs the accounts' JWTs
    DIR/keys/nats/mesh.nk       the MESH account's own seed (its JWT names the signer)
    DIR/keys/nats/system.nk     the SYS account's seed: signs its users
    DIR/keys/nats/signer.nk     MESH's signing key: signs every user of the mesh
"""

import json
import os
from pathlib import Path

import msgspec

from mesh.auth import claims
from mesh.auth.claims import Key
from mesh.auth.policy import User, permissions
from mesh.errors import MeshError

ACCOUNT = "MESH"
SYSTEM = "SYS"
OPERATOR = "mesh"
# The users of the system account and what each may do there: the seat's kicker (the
# controllers'), and the folder's claims pusher (a new account JWT, after a revocation).
KICK = "$SYS.REQ.SERVER.*.KICK"
KICKER_INBOX = "_INBOX_mesh_system"
CLAIMS = ["$SYS.REQ.CLAIMS.UPDATE", "$SYS.REQ.ACCOUNT.*.CLAIMS.UPDATE"]
CLAIMS_INBOX = "_INBOX_mesh_claims"


class TrustError(MeshError):
    """A key of the folder that cannot be read or made; the message names the file."""


class Revoked(msgspec.Struct, frozen=True):
    """A user key the account refuses: its JWTs issued at or before `at` (seconds)."""

    public: str
    at: int


class Trust:
    def __init__(self, *, operator: Key, system: Key, account: Key, signer: Key) -> None:
        self.operator = operator
        self.system = system
        self.account = account
        self.signer = signer

    @classmethod
    def of(cls, keys: Path) -> "Trust":
        """The keys in the folder `keys` (a mesh's `DIR/keys/nats`), each made once if missing."""
        keys.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(keys, 0o700)
        return cls(
            operator=key_file(keys / "operator.nk", "operator"),
            system=key_file(keys / "system.nk", "account"),
            account=key_file(keys / "mesh.nk", "account"),
            signer=key_file(keys / "signer.nk", "account"),
        )

    # --- what the servers are given ----------------------------------------------------------

    def operator_jwt(self) -> str:
        return claims.operator(self.operator, name=OPERATOR, system_account=self.system.public,
                               signing_keys=[])  # fmt: skip

    def system_jwt(self) -> str:
        return claims.account(self.operator, subject=self.system.public, name=SYSTEM,
                              signing_keys=[], jetstream=False)  # fmt: skip

    def account_jwt(self, revoked: list[Revoked]) -> str:
        return claims.account(
            self.operator, subject=self.account.public, name=ACCOUNT,
            signing_keys=[self.signer.public], jetstream=True,
            revocations={r.public: r.at for r in revoked},
        )  # fmt: skip

    def server_block(self, revoked: list[Revoked]) -> str:
        """What every server's configuration includes: the operator, the system account, and
        both accounts' JWTs preloaded into its resolver (natsd.write_config adds the resolver,
        whose folder is each server's own)."""
        q = json.dumps
        return "\n".join([
            "# Written by mesh from the mesh's keys and users (creds/users.json): edits here are",
            "# overwritten. No user is listed: each presents a JWT signed by the mesh's signer.",
            f"operator: {q(self.operator_jwt())}",
            f"system_account: {q(self.system.public)}",
            "resolver_preload: {",
            f"  {self.system.public}: {q(self.system_jwt())}",
            f"  {self.account.public}: {q(self.account_jwt(revoked))}",
            "}",
            "",
        ])  # fmt: skip

    # --- users ---------------------------------------------------------------------------------

    def user_jwt(self, user: User) -> str:
        """The JWT of a mesh identity, its permissions as mesh/auth/policy.py decides them."""
        return sign_user(self.signer, account=self.account.public, user=user)

    def kicker_jwt(self, public: str) -> str:
        """The seat's kicker: KICK alone (mesh/auth/system.py says why)."""
        return claims.user(self.system, account_public=self.system.public, subject=public,
                           name="kicker", publish=[KICK],
                           subscribe=[f"{KICKER_INBOX}.>"])  # fmt: skip

    def claims_jwt(self, public: str) -> str:
        """The folder's pusher of account JWTs: CLAIMS alone."""
        return claims.user(self.system, account_public=self.system.public, subject=public,
                           name="claims", publish=CLAIMS,
                           subscribe=[f"{CLAIMS_INBOX}.>"])  # fmt: skip


def sign_user(signer: Key, *, account: str, user: User) -> str:
    """A mesh identity's JWT, signed by the account's signing key (the folder's, or the
    controllers' when a machine joins: services/controller/fleet/admission.py)."""
    p = permissions(user)
    return claims.user(
        signer, account_public=account, subject=user.public, name=f"{user.kind}:{user.name}",
        publish=p.publish, subscribe=p.subscribe, responses=p.responses,
    )  # fmt: skip


def key_file(path: Path, kind: claims.KeyKind) -> Key:
    """The key in `path`, made (mode 0600, its folder 0700) if there is none."""
    try:
        return claims.key_of(path.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        raise TrustError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
    key = claims.new_key(kind)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (key.seed + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key
