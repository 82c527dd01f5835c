"""Which version a rollback takes a module back to, as pure functions over its history
(mesh.store.modules.history: newest first), and the words that list the versions it has.

A version is named by its number (`3`), by its digest (`sha256:…`), or by a prefix of the
digest long enough to name one version (`sha256:` may be left out). Without a name, the version
before the current one: the newest numbered below it that ran, that is whose last rollout did
not end failed, reverted or cancelled (a version that never ran is no version to go back to).
"""

import difflib

from mesh import wire
from mesh.model import BundleChange
from mesh.store.modules import HistoryRow, StoredVersion

LISTED = 20  # versions a refusal names, newest first; `mesh history` shows them all
SHORT = 19  # `sha256:` and 12 hex digits: how a digest is shown in a line
MIN_PREFIX = 4  # hex digits of a digest prefix at least: fewer would name too much by chance
# How a version's last rollout ended when it never ran on the machines it went to.
NEVER_RAN = ("failed", "reverted", "cancelled", "rejected")


def known(rows: list[HistoryRow]) -> str:
    """The versions, newest first, as a refusal lists them: `3 (current), 2, 1 (sha256:…)`."""
    if not rows:
        return "none"
    shown = [
        f"{r.number} ({r.digest[:SHORT]}{', current' if r.current else ''})" for r in rows[:LISTED]
    ]
    more = f" and {len(rows) - LISTED} older (mesh history)" if len(rows) > LISTED else ""
    return ", ".join(shown) + more


def pick(rows: list[HistoryRow], *, module: str, to: str | None) -> HistoryRow:
    """The version `to` names, or the one before the current; refused in one line that names
    what was asked and lists the versions there are."""
    if not rows:
        raise wire.BadRequest(f"module {module} has never been pushed", code="not_found")
    if to is None:
        return _before_current(rows, module=module)
    if to.isdigit():
        found = [r for r in rows if r.number == int(to)]
    else:
        digest = to if to.startswith("sha256:") else f"sha256:{to}"
        hexed = digest.removeprefix("sha256:")
        if len(hexed) < MIN_PREFIX or not all(c in "0123456789abcdef" for c in hexed):
            raise wire.BadRequest(
                f"to: {to!r} is neither a version number nor a digest (sha256:… or at least "
                f"{MIN_PREFIX} of its hex digits); module {module} has {known(rows)}"
            )
        found = [r for r in rows if r.digest.startswith(digest)]
    if not found:
        raise wire.BadRequest(
            f"module {module} has no version {to}; its versions: {known(rows)}", code="not_found"
        )
    if len(found) > 1:
        raise wire.BadRequest(
            f"to: {to!r} names {len(found)} versions of module {module} "
            f"({', '.join(str(r.number) for r in found[:LISTED])}): give more of the digest"
        )
    return found[0]


def current(rows: list[HistoryRow], *, module: str) -> HistoryRow:
    """The module's current version; refused when it has none (registered nowhere)."""
    found = next((r for r in rows if r.current), None)
    if found is None:
        raise wire.BadRequest(
            f"module {module} has no current version (its first push is held, or was taken "
            f"back): approve it, or push again; its versions: {known(rows)}",
            code="not_found",
        )
    return found


def _before_current(rows: list[HistoryRow], *, module: str) -> HistoryRow:
    current_ = current(rows, module=module)
    for r in rows:
        if r.number < current_.number and r.state not in NEVER_RAN:
            return r
    raise wire.BadRequest(
        f"module {module} has no version before its current one ({current_.number}) that ran; "
        f"name one with --to: {known(rows)}",
        code="not_found",
    )


def compared(a: StoredVersion, b: StoredVersion, *, numbers: tuple[int, int]) -> tuple[
    list[str], list[BundleChange]
]:  # fmt: skip
    """What changed from `a` to `b`: their module.toml as a unified diff, and the bundles whose
    digest differs (a changed file of the module's source shows as its bundle's new digest)."""
    was, now = (f"version {n}/module.toml" for n in numbers)
    lines = list(
        difflib.unified_diff(
            a.manifest.splitlines(), b.manifest.splitlines(), was, now, lineterm=""
        )
    )
    bundles = [
        BundleChange(bundle=name, before=a.bundles.get(name), after=b.bundles.get(name))
        for name in sorted(a.bundles.keys() | b.bundles.keys())
        if a.bundles.get(name) != b.bundles.get(name)
    ]
    return lines, bundles
