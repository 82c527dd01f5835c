"""Decoding and encoding bodies: size limits, strict decoding, and errors that name the field."""

from typing import TypeVar

import msgspec

from mesh.model import ErrorBody, ErrorCode, ErrorReply

T = TypeVar("T")

MAX_BODY = 64 * 1024  # verb bodies are small; anything larger is refused before decoding
MAX_REPORT = 1024 * 1024  # a host's report (its tools: services/host/tools.py keeps them smaller)

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


def decode(data: bytes, into: type[T], *, limit: int = MAX_BODY) -> T:
    """Decode a JSON body into `into`, strictly. An empty body is an empty object."""
    if len(data) > limit:
        raise BadRequest(f"body is {len(data)} bytes, at most {limit}", code="too_large")
    if data.startswith(_JETSTREAM_ANSWER):
        raise BadRequest("body is an answer of the JetStream API, not a message of the mesh")
    try:
        return msgspec.json.decode(data or b"{}", type=into)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid body: {e}") from None
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
        maybe = msgspec.json.decode(data, type=_MaybeError)
    except msgspec.DecodeError as e:
        raise RemoteError("bad_reply", f"the reply is not valid JSON: {e}") from None
    if maybe.error is not None:
        raise RemoteError(maybe.error.code, maybe.error.message)
    try:
        return msgspec.json.decode(data, type=into)
    except msgspec.ValidationError as e:
        raise RemoteError("bad_reply", f"unexpected reply: {e}") from None
