"""`python -m programs.cli` is the `mesh` command: how `mesh dev up` and `mesh init` start their
pieces (`sys.executable`, so the same interpreter and packages, whatever PATH says)."""

from programs.cli.main import main

if __name__ == "__main__":
    main()
