"""System accounts and groups, created with the system's tools. Whether one exists is decided by
`getent`'s exit code (0 found, 2 absent), never by reading message text: reading text is how the
seed's host took a missing account for a user database that did not answer."""

import subprocess
from collections.abc import Sequence


class AccountError(Exception):
    pass


def _exists(database: str, name: str) -> bool:
    found = subprocess.run(["getent", database, name], capture_output=True)
    if found.returncode == 0:
        return True
    if found.returncode == 2:
        return False
    raise AccountError(f"getent {database} {name} failed with exit code {found.returncode}")


def exists(name: str) -> bool:
    return _exists("passwd", name)


def group_exists(name: str) -> bool:
    return _exists("group", name)


def _run(argv: list[str]) -> None:
    made = subprocess.run(argv, capture_output=True, text=True)
    if made.returncode not in (0, 9):  # 9: the name exists (made meanwhile by someone else)
        raise AccountError(
            f"{argv[0]} {argv[-1]} failed ({made.returncode}): {made.stderr.strip()}"
        )


def ensure_system_account(
    name: str,
    *,
    home: str | None = None,
    shell: str = "/usr/sbin/nologin",
    groups: Sequence[str] = (),
) -> bool:
    """Create the account (and its extra groups) unless it exists; True if created now."""
    for group in groups:
        if not group_exists(group):
            _run(["groupadd", "--system", group])
    if exists(name):
        return False
    argv = ["useradd", "--system", "--user-group", "--shell", shell]
    argv += ["--home-dir", home, "--create-home"] if home else ["--no-create-home"]
    if groups:
        argv += ["--groups", ",".join(groups)]
    _run([*argv, name])
    return True
