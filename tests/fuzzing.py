"""Hypothesis strategies for fuzzing: bodies built from the request Structs themselves, so a
verb added tomorrow is fuzzed with near-valid bodies without anyone writing a strategy for it.

`values(T)` draws valid values of a msgspec type (names, digests, tiers within their bounds);
`near_valid(Struct)` draws objects with that Struct's fields, then breaks a few of them (a wrong
type, a huge number, a null, unicode, a missing or an extra field); `bodies(Struct, limit)` mixes
those with random bytes, random JSON and bodies just over the verb's size limit.
"""

import json
import math
from typing import Any

import msgspec.inspect as mi
from hypothesis import strategies as st

# Values the running mesh knows, so near-valid bodies reach past "not found" now and then.
KNOWN_NAMES = ["hello", "node-1", "fuzz-1", "hello-token", "ctl-a", "hello-clash"]

NASTY_STRINGS = [
    "", " ", ".", "..", "../../etc/passwd", "/etc/shadow", "a.b", "*", ">", "mesh.ctl.>",
    "\x00", "\u202e", "\ud7ff", "💥", "\uff48\uff45\uff4c\uff4c\uff4f", "x" * 65, "x" * 256,
    "sha256:", "sha256:" + "0" * 63,
    "1e999", "-1", "NaN", "null", "{}", "[]", '"', "\\", "%s%n", "${HOME}", "$(id)", "sh -c id",
    "0ms", "2s", "168h", "169h", "9" * 400 + "s", "0400", "0777", "8080:80", "docker.io/x",
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.floats(),  # inf and nan too: json.dumps writes them as Infinity and NaN, not JSON
    st.text(max_size=40),
    st.sampled_from(NASTY_STRINGS),
)
HUGE = ["x" * 100_000, 10**40, -(10**40), [0] * 20_000, 1e308, {"k": "v" * 10_000}]

json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=25,
)


def _strings(t: mi.StrType) -> st.SearchStrategy[str]:
    lo, hi = t.min_length or 0, t.max_length
    if t.pattern:
        drawn: st.SearchStrategy[str] = st.from_regex(t.pattern, fullmatch=True)
        if "A-Za-z0-9" in t.pattern:  # a name: sometimes one the mesh knows
            drawn = st.one_of(drawn, st.sampled_from(KNOWN_NAMES))
        return drawn.filter(lambda s: lo <= len(s) <= (hi if hi is not None else len(s)))
    return st.one_of(
        st.text(min_size=lo, max_size=min(hi if hi is not None else 40, 40)),
        st.from_regex(r"[a-z][a-z0-9_-]{0,10}", fullmatch=True),
        st.sampled_from(KNOWN_NAMES + NASTY_STRINGS),
    ).filter(lambda s: lo <= len(s) <= (hi if hi is not None else len(s)))


def _bound(t: Any, default: float) -> tuple[float | None, float | None]:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    return lo, hi


def values(t: mi.Type, depth: int = 0) -> st.SearchStrategy[Any]:
    """Valid values (as JSON-able builtins) of the msgspec type `t`, mostly."""
    if depth > 4:
        return st.none()
    match t:
        case mi.Metadata():
            return values(t.type, depth)
        case mi.StrType():
            return _strings(t)
        case mi.BoolType():
            return st.booleans()
        case mi.IntType():
            lo, hi = _bound(t, 0)
            return st.integers(
                min_value=int(lo) + (t.gt is not None) if lo is not None else -(2**40),
                max_value=int(hi) - (t.lt is not None) if hi is not None else 2**40,
            )
        case mi.FloatType():
            lo, hi = _bound(t, 0)
            return st.floats(
                min_value=lo if lo is not None else -1e9,
                max_value=hi if hi is not None else 1e9,
                exclude_min=t.gt is not None,
                exclude_max=t.lt is not None,
                allow_nan=False,
            )
        case mi.NoneType():
            return st.none()
        case mi.LiteralType():
            return st.sampled_from(list(t.values))
        case mi.UnionType():
            return st.one_of([values(x, depth + 1) for x in t.types])
        case mi.ListType() | mi.SetType() | mi.FrozenSetType() | mi.VarTupleType():
            hi = min(t.max_length if t.max_length is not None else 3, 3)
            return st.lists(values(t.item_type, depth + 1), min_size=0, max_size=hi)
        case mi.DictType():
            hi = min(t.max_length if t.max_length is not None else 3, 3)
            keys = values(t.key_type, depth + 1)
            if not isinstance(t.key_type, mi.StrType):  # JSON keys are strings, whatever T says
                keys = st.text(max_size=12)
            return st.dictionaries(keys, values(t.value_type, depth + 1), max_size=hi)
        case mi.StructType():
            return near_valid(t.cls, depth + 1, broken=0)
        case mi.DateTimeType():
            return st.datetimes().map(lambda d: d.isoformat() + "Z")
        case _:  # Any, Raw and the rest: anything JSON
            return json_values


def _field_types(cls: type) -> list[mi.Field]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType), cls
    return list(info.fields)


def near_valid(cls: type, depth: int = 0, *, broken: int = 3) -> st.SearchStrategy[dict]:
    """Objects with `cls`'s fields, valid values, then up to `broken` of them broken."""
    fields = _field_types(cls)

    @st.composite
    def build(draw: st.DrawFn) -> dict:
        body: dict[str, Any] = {}
        for f in fields:
            if f.required or draw(st.booleans()):
                body[f.encode_name] = draw(values(f.type, depth))
        for _ in range(draw(st.integers(0, broken))):
            how = draw(st.sampled_from(["wrong", "wrong", "null", "drop", "extra", "huge"]))
            name = draw(st.sampled_from([f.encode_name for f in fields])) if fields else "x"
            if how == "wrong":
                body[name] = draw(json_values)
            elif how == "null":
                body[name] = None
            elif how == "drop":
                body.pop(name, None)
            elif how == "extra":
                body[draw(st.text(max_size=20))] = draw(scalars)
            else:
                body[name] = draw(st.sampled_from(HUGE))
        return body

    return build()


def dumps(value: Any, *, ascii_only: bool = True) -> bytes:
    # surrogatepass: a lone surrogate becomes bytes that are not UTF-8, which is one more case
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def bodies(cls: type, *, limit: int, max_payload: int) -> st.SearchStrategy[bytes]:
    """Request bodies for a verb whose request Struct is `cls` and whose size limit is `limit`."""
    near = st.builds(dumps, near_valid(cls), ascii_only=st.booleans())
    kinds = [
        st.binary(max_size=300),
        st.builds(dumps, json_values, ascii_only=st.booleans()),
        near,
        near,
        near,
        near,
        st.builds(dumps, near_valid(cls, broken=0)),  # valid, as far as types go
        st.sampled_from([b"", b"{}", b"null", b"[]", b'""', b"0", b"{", b"\xff\xfe", b"{}{}"]),
    ]
    if limit + 2048 < max_payload:  # the server refuses larger payloads before we could
        kinds.append(st.integers(1, 2048).map(lambda n: b'{"pad": "' + b"x" * (limit + n) + b'"}'))
    return st.one_of(kinds)


# --- TOML ------------------------------------------------------------------------------------


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        # A JSON string is a TOML basic string, but for characters outside the BMP: JSON writes
        # them as surrogate pairs, which TOML refuses; unescaped, they stay themselves.
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        pairs = (f"{toml_value(str(k))} = {toml_value(x)}" for k, x in v.items() if x is not None)
        return "{" + ", ".join(pairs) + "}"
    return '""'  # TOML has no null


def toml_document(doc: dict[str, Any]) -> str:
    """One `key = value` line per top-level key (tables as inline tables)."""
    return "\n".join(f"{toml_value(str(k))} = {toml_value(v)}" for k, v in doc.items()) + "\n"


def manifests(manifest_cls: type) -> st.SearchStrategy[str]:
    """module.toml texts: near-valid manifests, random TOML, and random text."""
    return st.one_of(
        near_valid(manifest_cls, broken=2).map(toml_document),
        near_valid(manifest_cls, broken=0).map(toml_document),
        st.dictionaries(st.text(max_size=10), json_values, max_size=5).map(toml_document),
        st.text(max_size=400),
    )
