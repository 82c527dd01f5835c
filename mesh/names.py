"""Names that become NATS subject tokens: machine, verb and module names.

A name is interpolated into subjects like `mesh.host.<name>.beat`, so a dot, a wildcard or
whitespace in it would let one machine speak on another's subjects. Validate before use.
"""

import re

from mesh.errors import MeshError

MAX_NAME = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


class InvalidName(MeshError, ValueError):
    """A name that cannot be a subject token; the message names the field and the value."""


def check_name(value: object, *, field: str = "name") -> str:
    """Return `value` if it is a valid name, else raise InvalidName naming `field` and the value."""
    if not isinstance(value, str):
        raise InvalidName(f"{field}: expected a string, got {type(value).__name__}")
    if value == "":
        raise InvalidName(f"{field}: must not be empty")
    if len(value) > MAX_NAME:
        raise InvalidName(
            f"{field}: {value[:20]!r}… is {len(value)} characters, at most {MAX_NAME}"
        )
    if not _NAME.fullmatch(value):
        raise InvalidName(
            f"{field}: {value!r} is not a valid name: use letters, digits, '-' and '_', "
            "starting with a letter or digit (no dots, spaces or wildcards '*' '>')"
        )
    return value
