"""Printing: one JSON document with --json, rich tables otherwise."""

import sys
from typing import Any

import msgspec
from rich.console import Console


def console() -> Console:
    # In a terminal, rich fits its width; piped, it would assume 80 columns and wrap the rows.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def print_json(value: object) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def whole(reply: msgspec.Struct) -> dict[str, Any]:
    """A list put together from its pages (client.every_page) as one document: the reply's
    shape without `next`, which only a page has. Its fields only: the items stay Structs,
    which msgspec encodes ten times faster than the dicts to_builtins would make of them."""
    document = msgspec.structs.asdict(reply)
    document.pop("next", None)
    return document


def more(out: Console, *, shown: int, total: int, want: int | None, what: str) -> None:
    """Say that `--limit` cut the list, and by how much (`what`: one of the items)."""
    if want is not None and shown >= want and total > shown:
        left = total - shown
        out.print(f"… {left:,} more {what}{'s' if left != 1 else ''}; raise --limit to see them")
