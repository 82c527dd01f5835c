"""`python -m mesh` is the `mesh` command: the dev cluster starts its pieces this way."""

from mesh.cli.main import main

if __name__ == "__main__":
    main()
