"""The `mesh` command line: one client of the controller's verbs, and the way services are run."""

import sys


def command(*args: str) -> list[str]:
    """The argv that runs `mesh ARGS` in this interpreter, with its packages whatever PATH says
    (`python -m programs.cli`); -P: never a `mesh` folder in the working directory."""
    return [sys.executable, "-P", "-m", "programs.cli", *args]
