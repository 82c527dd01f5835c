"""Decoding and encoding bodies: size limits, nesting limits, strict decoding, and errors that
name the field.

Every JSON body the mesh's pieces take from each other or from a client (verbs, hosts' reports,
replies, values in the bus's buckets, a tool server's messages) goes through `decode`,
`decode_reply` or `decode_json`: each measures how deep arrays and objects nest before
decoding. msgspec's decoder recurses once per level, and past Python's recursion limit (about
1,000) it raises RecursionError, which no caller expects: a body nested 5,000 deep was an
`internal` error and a traceback in the holder's log.
"""

import re
from itertools import accumulate
from typing import Any, TypeVar

import msgspec

from mesh.model import ErrorBody, ErrorCode, ErrorReply
from mesh.names import InvalidName, check_name

T = TypeVar("T")

MAX_BODY = 64 * 1024  # verb bodies are small; anything larger is refused before decoding
MAX_REPORT = 1024 * 1024  # a host's report (its tools: services/host/tools.py keeps them smaller)
# Arrays and objects inside each other, at most: far more than any message of the mesh (a tool's
# input schema included) and far below where the decoder's recursion would fail.
MAX_DEPTH = 64

_encoder = msgspec.json.Encoder()
# How every answer of the JetStream API starts. Anyone who may ask it can name any subject as
# the reply (nats-server does not check reply subjects), so its answers can be made to land on
# a subject of ours, with attacker-chosen parts (a consumer's name): never taken as a message
# of ours, whatever fields it happens to have (mesh/origin.py).
_JETSTREAM_ANSWER = b'{"type":"io.nats.'


class BadRequest(Exception):
    """A request that cannot be served; `code` and the message go back to the caller."""

    def __init__(self, message: str, *, code: ErrorCode = "bad_request") -> None:
        super().__init__(message)
        self.code = code


def subject_name(name: str, *, field: str) -> str:
    """A name taken from a request's subject (a machine's, an operator's), checked: a bad one
    is the request's `bad_request`, naming `field`."""
    try:
        return check_name(name, field=field)
    except InvalidName as e:
        raise BadRequest(str(e)) from None


class TooDeep(msgspec.DecodeError):
    """JSON nested deeper than the limit, refused before decoding. A DecodeError, so whoever
    already refuses malformed JSON refuses this too."""

    def __init__(self, depth: int, limit: int) -> None:
        super().__init__(f"arrays and objects nested {depth} deep, at most {limit}")
        self.depth = depth
        self.limit = limit


# A JSON string, escapes included: the brackets inside one are text, not nesting.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_AS_PARENS = bytes.maketrans(b"[{]}", b"(())")
_STEP = [0] * 256
_STEP[ord("(")], _STEP[ord(")")] = 1, -1


def check_depth(data: bytes, *, limit: int = MAX_DEPTH) -> None:
    """Raise TooDeep if arrays and objects in the JSON `data` nest more than `limit` deep.
    On the bytes, never recursing: strings are cut out and the brackets left are paired off.
    Malformed JSON may pass here (the decoder refuses it then, without recursing deeper)."""
    marks = _STRING.sub(b"", data).translate(_AS_PARENS, _NOT_BRACKETS)
    if marks.count(b"(") <= limit:
        return
    rest = marks
    for _ in range(limit):  # each round takes the innermost pairs away: one level of nesting
        rest = rest.replace(b"()", b"")
        if not rest:
            return
    # Deeper than `limit`, or brackets that do not pair: the exact depth, once, to name it.
    deepest = max(accumulate(map(_STEP.__getitem__, marks)), default=0)
    if deepest > limit:
        raise TooDeep(deepest, limit)


def decode_json(data: bytes, into: Any = Any, *, depth: int = MAX_DEPTH) -> Any:
    """msgspec.json.decode with the nesting checked first (TooDeep, a DecodeError): for a
    body that is not a request (a reply, a report, a bucket's value, a tool server's line)."""
    if len(data) > depth:  # shorter, it cannot nest deeper: each level takes a byte
        check_depth(data, limit=depth)
    return msgspec.json.decode(data, type=into)


def decode(data: bytes, into: type[T], *, limit: int = MAX_BODY) -> T:
    """Decode a JSON body into `into`, strictly. An empty body is an empty object."""
    if len(data) > limit:
        raise BadRequest(f"body is {len(data)} bytes, at most {limit}", code="too_large")
    if data.startswith(_JETSTREAM_ANSWER):
        raise BadRequest("body is an answer of the JetStream API, not a message of the mesh")
    try:
        return decode_json(data or b"{}", into)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid body: {e}") from None
    except TooDeep as e:
        raise BadRequest(f"body: {e}") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None


def encode(value: object) -> bytes:
    return _encoder.encode(value)


def error(code: ErrorCode, message: str) -> bytes:
    return encode(ErrorReply(error=ErrorBody(code=code, message=message)))


class RemoteError(Exception):
    """The other side answered with an error reply (any code it sent, or our `bad_reply`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _AnyError(msgspec.Struct):
    # Any code, not only ErrorCode's: a newer peer may answer with a code this side has not
    # heard of, and its message must still reach the user rather than turn into `bad_reply`.
    code: str
    message: str


class _MaybeError(msgspec.Struct):
    error: _AnyError | None = None


def decode_reply(data: bytes, into: type[T]) -> T:
    """Decode a reply; an error reply raises RemoteError with its code and message."""
    try:
        maybe = decode_json(data, _MaybeError)
    except TooDeep as e:
        raise RemoteError("bad_reply", f"the reply: {e}") from None
    except msgspec.DecodeError as e:
        raise RemoteError("bad_reply", f"the reply is not valid JSON: {e}") from None
    if maybe.error is not None:
        raise RemoteError(maybe.error.code, maybe.error.message)
    try:
        return msgspec.json.decode(data, type=into)
    except msgspec.ValidationError as e:
        raise RemoteError("bad_reply", f"unexpected reply: {e}") from None
