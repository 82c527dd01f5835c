"""NATS user nkeys: an Ed25519 seed (the private half, kept in a credentials file) and its public
key (the only half the server's configuration holds)."""

import os

import msgspec
import nkeys


class UserKey(msgspec.Struct, frozen=True):
    seed: str  # "SU…": whoever has it is this user
    public: str  # "U…": what the server knows


def new_user() -> UserKey:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    return UserKey(seed=seed, public=public_of(seed))


def public_of(seed: str) -> str:
    """The public key of a user seed; raises ValueError for anything that is not one."""
    if not seed.startswith("SU"):
        raise ValueError("not a NATS user seed (it should start with SU)")
    try:
        pair = nkeys.from_seed(bytearray(seed.encode()))
    except nkeys.NkeysError as e:
        raise ValueError(f"not a valid NATS user seed ({type(e).__name__})") from None
    try:
        return pair.public_key.decode()
    finally:
        pair.wipe()
