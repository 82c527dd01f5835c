"""How the mesh runs its own command: `mesh dev up` and `mesh init` start every piece with it,
and the benches and tests run `mesh ...` with it. The command line stands above the library
(programs/cli/), so it is named here as a module to run, never imported."""

import sys

ENTRY = "programs.cli"  # `python -m programs.cli` is the `mesh` command


def command(*args: str) -> list[str]:
    """The argv that runs `mesh ARGS` in this interpreter, with its packages whatever PATH says;
    -P: never a `mesh` folder in the working directory."""
    return [sys.executable, "-P", "-m", ENTRY, *args]
