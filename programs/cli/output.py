"""Printing: one JSON document with --json, rich tables otherwise."""

import sys

import msgspec
from rich.console import Console


def console() -> Console:
    # In a terminal, rich fits its width; piped, it would assume 80 columns and wrap the rows.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def print_json(value: object) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")
