"""`python -m mesh` is the `mesh` command (how `mesh dev up` starts its pieces, and how they show
in `ps`). The one file of the library that looks up: it hands over to the command line, which
stands above the library and the services (programs/)."""

from programs.cli.main import main

if __name__ == "__main__":
    main()
