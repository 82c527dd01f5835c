#!/usr/bin/env python3
"""A FAKE `getent`, for tests only: a user database that fails for one name.

A test links this file as `getent` in a folder it puts first on a host's PATH. For each name
in FAKE_GETENT_FAIL ("NAME=HOW,..."), it fails the way a broken user database (NSS, LDAP, sssd)
makes the real tool fail: HOW is an exit code ("1"), or "crash" (killed by SIGSEGV). Every
other lookup is the real `getent`'s, so the rest of the host works as usual.
"""

import os
import shutil
import signal
import sys

here = os.path.dirname(os.path.abspath(sys.argv[0]))
failing = dict(
    item.split("=", 1) for item in os.environ.get("FAKE_GETENT_FAIL", "").split(",") if item
)
how = failing.get(sys.argv[2]) if len(sys.argv) > 2 else None
if how == "crash":
    os.kill(os.getpid(), signal.SIGSEGV)
if how is not None:
    sys.exit(int(how))
path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != here)
real = shutil.which("getent", path=path)
if real is None:
    sys.exit("fake getent: no real getent on PATH")
os.execv(real, [real, *sys.argv[1:]])
