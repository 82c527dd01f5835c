"""System accounts and groups, created with the system's tools. Whether one exists is decided by
`getent`'s exit code (0 found, 2 absent), never by reading message text: reading text is how the
seed's host took a missing account for a user database that did not answer.

And which accounts and groups a module may not have (docs/modules.md, privileged accounts and
groups): the registration gate refuses them at push and the host again before it creates an
account, by the same rules (`refusal`), so a declaration that came some other way is refused too.
"""

import fcntl
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

# Held while an account or group is made. useradd's own lock does not always hold: two at once
# for one name both succeed, the second rewriting the first's uid (seen on Debian 12), so a
# process that looked the first up runs as a uid no account has.
LOCK = Path("/etc/.mesh-accounts.lock")
LOCK_WITHIN = 30.0

PG_ACCOUNT = "mesh-postgres"  # the embedded PostgreSQL's (mesh/embedded/postgres.py)
BUILD_ACCOUNT = "mesh-build"  # a builder's builds' (services/host/builder.py)
CONTROLLER = "mesh-controller"  # the controller's account, and the module that declares it

# Accounts no module may declare, and why.
RESERVED_ACCOUNTS = {
    "root": "the superuser's account: a process runs as root only with `root = true` (and no "
    "account)",
    PG_ACCOUNT: "the mesh's store runs as it and owns its data",
    BUILD_ACCOUNT: "every build of the fleet runs as it: a process of it could change what "
    "other modules build",
}
# Accounts only one module may declare: CONTROLLER reads the store's password and the
# controller's NATS credentials.
OWNED_ACCOUNTS = {CONTROLLER: CONTROLLER}
# Groups no account of a module may join: gid 0 owns much of the system (`root = true` is how a
# process is root).
NEVER_GROUPS = {"root": "gid 0, root's own group: a process runs as root only with `root = true`"}
# Groups whose members are root, or read what only root should, in all but name. An account
# joins one only when its module names it in `privileged_groups`, never through `groups`.
PRIVILEGED_GROUPS = {
    "sudo": "sudo grants it root",
    "wheel": "sudo and su grant it root",
    "admin": "sudo grants it root (older Ubuntu)",
    "disk": "it reads and writes the disks' block devices, so every file on them",
    "docker": "the Docker engine's socket: a container with / mounted is root on the machine",
    "lxd": "LXD's socket: a privileged container is root on the machine",
    "incus-admin": "Incus's socket: a privileged container is root on the machine",
    "libvirt": "it starts virtual machines with the machine's disks and devices",
    "shadow": "it reads /etc/shadow: every account's password hash",
    "adm": "it reads the system's logs, with what other services wrote there",
    "systemd-journal": "it reads every service's journal",
    "kmem": "it reads the kernel's memory",
    "staff": "it writes /usr/local, which comes first on root's PATH (Debian)",
}


class AccountError(Exception):
    pass


def refusal(
    name: str, *, groups: Sequence[str], privileged_groups: Sequence[str]
) -> tuple[str, str] | None:
    """Why an account must not be created or run as: (the field at fault, the sentence); None
    when it may. `privileged_groups` is the module's explicit word for each privileged group."""
    if name in RESERVED_ACCOUNTS:
        return "", f"{name!r} is reserved: {RESERVED_ACCOUNTS[name]}"
    for field, names in (("groups", groups), ("privileged_groups", privileged_groups)):
        for group in names:
            if group in NEVER_GROUPS:
                why = NEVER_GROUPS[group]
                return field, f"{group!r} is never given to a module's account: {why}"
    for group in groups:
        if group in PRIVILEGED_GROUPS:
            return "groups", (
                f"{group!r} is a privileged group ({PRIVILEGED_GROUPS[group]}): name it in "
                "privileged_groups if this account truly needs it"
            )
    for group in privileged_groups:
        if group not in PRIVILEGED_GROUPS:
            return "privileged_groups", (
                f"{group!r} is not a privileged group: name it in groups (privileged groups: "
                f"{', '.join(sorted(PRIVILEGED_GROUPS))})"
            )
    return None


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
    if exists(name) and all(group_exists(g) for g in groups):
        return False
    with _one_at_a_time():
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


@contextmanager
def _one_at_a_time() -> Iterator[None]:
    """Across processes (the hosts and stores of one machine), one maker of accounts at a time."""
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WITHIN
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AccountError(
                        f"{LOCK} is held by another process past {LOCK_WITHIN:.0f} s; "
                        "no account was made"
                    ) from None
                time.sleep(0.02)  # ok: a lock taken for milliseconds, polled with a deadline
        yield
    finally:
        os.close(fd)
