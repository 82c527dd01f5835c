"""What the controllers admit machines with (`mesh join`, services/controller/fleet/joining.py): the
mesh's NATS signing key (DIR/keys/nats/signer.nk, given to the controllers' module as the secret
`mesh-nats-signer`), whose signature every nats-server of the mesh trusts (mesh/auth/trust.py).

It signs two kinds of user: a join token's bearer credentials (its `join` request and its
answer alone, expiring with the token: what a new machine connects with before it has a key
that counts), and a joined machine's own (a host's permissions, for the public key the machine
made: its seed never leaves it). Without the key (an older mesh, or none given) a token is made
without bearer credentials and a join is refused, each saying why.
"""

import logging
from datetime import datetime
from pathlib import Path

import msgspec

from mesh.auth import claims, creds, policy
from mesh.auth.claims import Key
from mesh.auth.policy import User
from mesh.auth.trust import sign_user

log = logging.getLogger(__name__)


class Admission(msgspec.Struct, frozen=True):
    signer: Key
    account: str  # the account MESH, whose signing key `signer` is
    controller: str | None  # the controllers' public key: hosts check what they sign with it

    @classmethod
    def load(cls, signer_file: str | None, creds_file: str | None) -> "Admission | None":
        """The signing key in `signer_file` and the account named by the controllers' own
        credentials (`creds_file`); None, said once, when either is missing."""
        if not signer_file or not creds_file:
            log.info("no NATS signing key (MESH_NATS_SIGNER_FILE): machines cannot join here")
            return None
        try:
            signer = claims.key_of(Path(signer_file).read_text())
            held = creds.read(creds_file)
            account = claims.decode(held.user_jwt or "")["nats"].get("issuer_account", "")
        except (OSError, ValueError, KeyError, claims.ClaimsError, creds.CredsError) as e:
            log.warning("the NATS signing key %s cannot be used (%s): machines cannot join",
                        signer_file, e)  # fmt: skip
            return None
        if not account:
            log.warning("the controllers' credentials name no account: machines cannot join")
            return None
        controller = claims.key_of(held.seed).public if held.seed else None
        return cls(signer=signer, account=account, controller=controller)

    def machine_jwt(self, machine: str, public: str) -> str:
        """A joined machine's credentials' JWT: a host's permissions, for its own key."""
        return sign_user(self.signer, account=self.account,
                         user=User(name=machine, kind="host", public=public))  # fmt: skip

    def bearer(self, token_id: str, *, expires: datetime) -> str:
        """A token's bearer credentials: its `join` request and its answer, until it expires.
        A bearer JWT: the machine holds no seed for it (the token carries it whole)."""
        may = policy.joiner(token_id)
        return claims.user(
            self.signer, account_public=self.account, subject=claims.new_key("user").public,
            name=f"join:{token_id}", publish=may.publish, subscribe=may.subscribe,
            bearer=True, expires=int(expires.timestamp()),
        )  # fmt: skip
