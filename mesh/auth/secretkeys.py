"""The key of the secrets: a key-encryption key kept in a file, never in the store, and the
envelope that seals each secret under it.

PostgreSQL holds ciphertext only. Each secret has a data key of its own (AES-256-GCM, random),
which encrypts its value; the data key is kept wrapped (AES-256-GCM) by the mesh's
key-encryption key. That key is a file of mode 0600 outside the store: `DIR/keys/secrets.key`,
made by `mesh dev up` and `mesh init`; a controller reads the file `--secrets-key-file` or
`MESH_SECRETS_KEY_FILE` names, or `$MESH_FILES/secrets.key` when a host runs it.

The file holds one key per line (base64 of 32 bytes) and `#` comments. The first key wraps;
any after it only unwrap, while `mesh secret rotate-key` moves every data key to a new first
key. A key is known by its id (`k-` and 16 hex digits of a digest of it), which the store keeps
beside each wrapped data key, so a controller given a file without the key a secret needs says
which key it lacks instead of failing to decrypt.

What each seal is bound to (AES-GCM's associated data): a value to its secret's name and
version, a data key to its secret's name and the key's id. A row copied under another name, or
an older version's value put back, does not open.
"""

import base64
import binascii
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mesh.errors import MeshError
from mesh.paths import write_private

KEY_BYTES = 32  # AES-256
FILE_NAME = "secrets.key"  # the key file's name wherever it lies (DIR/keys, beside creds)
NONCE_BYTES = 12  # AES-GCM's standard nonce; random, and each key seals one value (a data key)
# or a handful of data keys (the key-encryption key: far below the 2**32 random nonces NIST
# allows one key)
_HEADER = """\
# The key of the mesh's secrets (mesh/auth/secretkeys.py): without it the secrets in the store
# cannot be read. Keep it mode 0600 and back it up apart from the store's backups.
# One key per line; the first encrypts, any after it only decrypt (during `mesh secret rotate-key`).
"""


class SecretsKeyError(MeshError):
    """A key file that cannot be used, or a secret that cannot be opened with it; the message
    names the file or the key, never a key's bytes."""


class KeyMissing(SecretsKeyError):
    """A secret is wrapped under a key this ring does not have."""

    def __init__(self, message: str, *, key_id: str) -> None:
        super().__init__(message)
        self.key_id = key_id


def key_id(key: bytes) -> str:
    return "k-" + hashlib.sha256(b"mesh secrets key id\0" + key).hexdigest()[:16]


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


@dataclass(frozen=True)
class Sealed:
    """A secret as the store keeps it: its value encrypted under its data key, the data key
    wrapped under the key `key_id` names. Each is the nonce followed by the ciphertext."""

    value: bytes
    data_key: bytes
    key_id: str


def _encrypt(key: bytes, plain: bytes, bound: bytes) -> bytes:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plain, bound)


def _decrypt(key: bytes, sealed: bytes, bound: bytes) -> bytes:
    return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], bound)


def _value_bound(name: str, version: int) -> bytes:
    return f"mesh secret value\0{name}\0{version}".encode()


def _key_bound(name: str, wrapping: str) -> bytes:
    return f"mesh secret data key\0{name}\0{wrapping}".encode()


@dataclass(frozen=True)
class KeyRing:
    """The keys of a key file, the one that wraps first."""

    keys: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.keys or any(len(k) != KEY_BYTES for k in self.keys):
            raise ValueError("a key ring holds one key or more, of 32 bytes each")

    @property
    def active(self) -> str:
        """The id of the key that wraps."""
        return key_id(self.keys[0])

    def ids(self) -> list[str]:
        return [key_id(k) for k in self.keys]

    def _key(self, wanted: str, *, name: str) -> bytes:
        for key in self.keys:
            if key_id(key) == wanted:
                return key
        raise KeyMissing(
            f"secret {name} is wrapped under key {wanted}, which the key file does not hold "
            f"(it holds {', '.join(self.ids())})",
            key_id=wanted,
        )

    def seal(self, *, name: str, version: int, value: bytes) -> Sealed:
        data_key = new_key()
        return Sealed(
            value=_encrypt(data_key, value, _value_bound(name, version)),
            data_key=_encrypt(self.keys[0], data_key, _key_bound(name, self.active)),
            key_id=self.active,
        )

    def _data_key(self, *, name: str, sealed: Sealed) -> bytes:
        kek = self._key(sealed.key_id, name=name)
        try:
            return _decrypt(kek, sealed.data_key, _key_bound(name, sealed.key_id))
        except InvalidTag:
            raise SecretsKeyError(
                f"secret {name}: its data key does not open under key {sealed.key_id} (the row "
                "was changed, or copied from another secret)"
            ) from None

    def open(self, *, name: str, version: int, sealed: Sealed) -> bytes:
        data_key = self._data_key(name=name, sealed=sealed)
        try:
            return _decrypt(data_key, sealed.value, _value_bound(name, version))
        except InvalidTag:
            raise SecretsKeyError(
                f"secret {name}: its value does not open as version {version} (the row was "
                "changed, or copied from another secret)"
            ) from None

    def rewrap(self, *, name: str, sealed: Sealed) -> Sealed:
        """The same value and data key, the data key wrapped under the active key."""
        data_key = self._data_key(name=name, sealed=sealed)
        wrapped = _encrypt(self.keys[0], data_key, _key_bound(name, self.active))
        return Sealed(value=sealed.value, data_key=wrapped, key_id=self.active)

    def first(self, key: bytes) -> "KeyRing":
        """`key` first, then the others (a rotation's start)."""
        return KeyRing((key, *(k for k in self.keys if k != key)))

    def only_active(self) -> "KeyRing":
        """The active key alone (a rotation's end)."""
        return KeyRing(self.keys[:1])

    def text(self) -> str:
        """The key file's content."""
        return _HEADER + "".join(base64.b64encode(k).decode() + "\n" for k in self.keys)


def parse(text: str, *, where: str) -> KeyRing:
    keys = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key = base64.b64decode(line, validate=True)
        except (binascii.Error, ValueError):
            raise SecretsKeyError(f"{where}: line {n} is not base64") from None
        if len(key) != KEY_BYTES:
            raise SecretsKeyError(f"{where}: line {n} holds {len(key)} bytes, not {KEY_BYTES}")
        keys.append(key)
    if not keys:
        raise SecretsKeyError(f"{where}: holds no key")
    return KeyRing(tuple(keys))


def read(path: Path) -> KeyRing:
    """The ring in `path`, refused if others may read the file (like ssh's keys)."""
    try:
        mode = path.stat().st_mode & 0o777
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise SecretsKeyError(
            f"secrets key file {path}: no such file; without it the store's secrets cannot be "
            "read: restore it from your backup (docs/operations.md, What to back up)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SecretsKeyError(
            f"secrets key file {path}: {getattr(e, 'strerror', None) or e}"
        ) from None
    if mode & 0o077:
        raise SecretsKeyError(
            f"secrets key file {path}: mode {mode:04o} lets other accounts read it; "
            f"chmod 600 {path}"
        )
    return parse(text, where=f"secrets key file {path}")


def write(path: Path, ring: KeyRing) -> None:
    """Atomically, mode 0600 (the folder 0700 if new)."""
    try:
        write_private(path, ring.text().encode())
    except OSError as e:
        raise SecretsKeyError(f"cannot write secrets key file {path}: {e.strerror or e}") from None


def make(path: Path) -> KeyRing:
    """A new key in a new file; never over a file that exists (that would lose its keys)."""
    if path.exists():
        raise SecretsKeyError(f"secrets key file {path} exists already")
    ring = KeyRing((new_key(),))
    write(path, ring)
    os.chmod(path.parent, 0o700)
    return ring
