"""`python -m mesh`, kept for what earlier versions wrote down: `mesh init --units` recorded its
pieces as `python -m mesh ...` in systemd units. The library does not import the command line
(it stands above the library); this replaces the process (same pid, so a supervisor sees no
change) with the same interpreter and flags running the command's entry now (mesh/entry.py).
Nothing in the mesh starts a piece through here."""

import os
import sys

from mesh.entry import ENTRY


def _forwarded(argv: list[str]) -> list[str]:
    """The interpreter's own argv with the module `mesh` run by `-m` swapped for the command's."""
    for i, word in enumerate(argv[:-1]):
        if word == "-m" and argv[i + 1] == "mesh":
            return [*argv[:i], "-m", ENTRY, *argv[i + 2 :]]
    # Run some other way (runpy, a debugger): the flags are lost, the arguments kept.
    return [sys.executable, "-m", ENTRY, *sys.argv[1:]]


if __name__ == "__main__":
    new = _forwarded(sys.orig_argv)
    os.execv(sys.executable, [sys.executable, *new[1:]])
