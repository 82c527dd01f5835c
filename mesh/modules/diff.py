"""What changes between two declarations of one machine: + added, ~ changed (old -> new), -
removed. Secret values are never in a declaration, so never in a diff either."""

from typing import Any, Literal

import msgspec

from mesh.modules.compose import Declaration


class Change(msgspec.Struct):
    op: Literal["+", "~", "-"]
    kind: str  # account | bundle | process | container | tool
    name: str
    fields: dict[str, tuple[Any, Any]] = {}  # changed field -> (old, new), for "~"


_SECTIONS = (("account", "accounts"), ("bundle", "bundles"), ("process", "processes"),
             ("container", "containers"), ("tool", "tools"))  # fmt: skip


def diff(old: Declaration | None, new: Declaration | None) -> list[Change]:
    changes: list[Change] = []
    for kind, attr in _SECTIONS:
        # `or {}`: a declaration without tool servers leaves `tools` unset
        before: dict[str, Any] = (getattr(old, attr) or {}) if old else {}
        after: dict[str, Any] = (getattr(new, attr) or {}) if new else {}
        for name in sorted(before.keys() | after.keys()):
            if name not in before:
                changes.append(Change(op="+", kind=kind, name=name))
            elif name not in after:
                changes.append(Change(op="-", kind=kind, name=name))
            elif before[name] != after[name]:
                a = msgspec.to_builtins(before[name])
                b = msgspec.to_builtins(after[name])
                fields = {
                    k: (a.get(k), b.get(k))
                    for k in sorted(a.keys() | b.keys())
                    if a.get(k) != b.get(k)
                }
                changes.append(Change(op="~", kind=kind, name=name, fields=fields))
    return changes
