"""System accounts, created with the system's tools. Whether an account exists is decided by
`getent`'s exit code (0 found, 2 absent), never by reading message text: reading text is how the
seed's host took a missing account for a user database that did not answer."""

import subprocess


class AccountError(Exception):
    pass


def exists(name: str) -> bool:
    found = subprocess.run(["getent", "passwd", name], capture_output=True)
    if found.returncode == 0:
        return True
    if found.returncode == 2:
        return False
    raise AccountError(f"getent passwd {name} failed with exit code {found.returncode}")


def ensure_system_account(name: str, *, home: str | None = None) -> None:
    if exists(name):
        return
    argv = ["useradd", "--system", "--user-group", "--shell", "/usr/sbin/nologin"]
    argv += ["--home-dir", home, "--create-home"] if home else ["--no-create-home"]
    made = subprocess.run([*argv, name], capture_output=True, text=True)
    if made.returncode not in (0, 9):  # 9: created meanwhile by someone else
        raise AccountError(f"useradd {name} failed ({made.returncode}): {made.stderr.strip()}")
