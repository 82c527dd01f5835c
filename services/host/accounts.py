"""Accounts on this machine, created with the system's tools (useradd, groupadd).

Existence is decided by exit codes (`getent`: 0 found, 2 absent), never by message text: the
seed's host read an account that did not exist yet as "the user database did not answer" and
stopped. Without root (dev mode) accounts map to the current user, and the host says so.
"""

import grp
import logging
import os
import pwd

from mesh import osaccounts
from mesh.modules.compose import DAccount

log = logging.getLogger(__name__)


class Identity:
    """Who a process or file belongs to on this machine."""

    def __init__(self, name: str, uid: int, gid: int, home: str) -> None:
        self.name, self.uid, self.gid, self.home = name, uid, gid, home

    def groups(self) -> list[int]:
        """The account's supplementary groups (the declared `groups`)."""
        try:
            return [g for g in os.getgrouplist(self.name, self.gid) if g != self.gid]
        except OSError:
            return []


def dev_mode() -> bool:
    return os.geteuid() != 0


def current() -> Identity:
    entry = pwd.getpwuid(os.geteuid())
    return Identity(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def ensure(name: str, account: DAccount) -> Identity:
    """The account, created if absent. Idempotent; in dev mode, the current user.

    The gate's rules hold here too, for a declaration that did not come through the gate: a
    reserved account (root, the mesh's own) is always refused; a privileged group not named in
    `privileged_groups` is refused when the account would be made with it (and in dev mode, as
    it would be). An account that exists is used as it is, its groups never changed, so one an
    older agent made is not refused after an upgrade: refusing it would stop every apply,
    the revert's too, at this first step."""
    privileged = account.privileged_groups or []
    refused = osaccounts.refusal(name, groups=account.groups, privileged_groups=privileged)
    if refused is not None and (not refused[0] or dev_mode() or not osaccounts.exists(name)):
        field, why = refused
        raise osaccounts.AccountError(f"account {name}{'.' + field if field else ''}: {why}")
    if dev_mode():
        return current()
    created = osaccounts.ensure_system_account(
        name, home=account.home, shell=account.shell, groups=[*account.groups, *privileged]
    )
    if created:
        log.info("created account %s", name)
    entry = pwd.getpwnam(name)
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        # `root = true` is how a process runs as root; an account never is a way round it
        raise osaccounts.AccountError(f"account {name} is root's (uid or gid 0): refused")
    return Identity(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def gid_of(group: str) -> int:
    return grp.getgrnam(group).gr_gid
