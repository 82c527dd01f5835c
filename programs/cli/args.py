"""Argument types and the parser class shared by every `mesh` command."""

import argparse
import sys
from typing import Any

import msgspec

from mesh import metrics
from mesh.model import NOTE_MOST, ModuleGlob
from mesh.names import InvalidName, check_name


def label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value")
    try:
        check_name(key, field="label key")
    except InvalidName as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if len(value) > 256 or not value.isprintable():  # as the controller takes it (mesh.model.Word)
        raise argparse.ArgumentTypeError(
            f"label {key}: the value is at most 256 printable characters"
        )
    return key, value


def tier(text: str) -> int:
    try:
        tier = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= tier <= 9:
        raise argparse.ArgumentTypeError(f"{tier} is out of range (0 to 9)")
    return tier


def count(text: str) -> int:
    """`--limit N`: how many items a list shows, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a count (1 or more)")
    return n


def note(text: str) -> str:
    """`--note`: one line of at most NOTE_MOST characters, as the controller takes it."""
    if len(text) > NOTE_MOST:
        raise argparse.ArgumentTypeError(f"{len(text)} characters; at most {NOTE_MOST}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} has a control character (one line, please)")
    return text


def module_glob(text: str) -> str:
    """`--modules GLOB`: a glob of module names, as the controller takes it."""
    try:
        return msgspec.convert(text, ModuleGlob)
    except msgspec.ValidationError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a glob of module names (letters, digits, - _ * ? [ ])"
        ) from None


LIMIT_HELP = "show at most N (asking only for the pages they need)"


def listen(text: str) -> metrics.Listen:
    """`--metrics ADDR:PORT` or `PORT` (127.0.0.1:PORT)."""
    try:
        return metrics.parse_listen(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


METRICS_HELP = "serve Prometheus metrics on http://ADDR:PORT/metrics (PORT: on 127.0.0.1); off"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        # One line, exit 2, like argparse, but without the usage block burying the message.
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)
