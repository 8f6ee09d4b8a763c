"""msgpack encoding of bus messages; decoders are built once per subject family."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

_ENCODER = msgspec.msgpack.Encoder()
T = TypeVar("T")


def encode(message: Any) -> bytes:
    """Encode a msgspec Struct (or anything msgspec encodes) as msgpack."""
    return _ENCODER.encode(message)


class DecodeError(ValueError):
    """A payload that is not a valid message of the expected type."""


def decode(decoder: msgspec.msgpack.Decoder[T], data: bytes) -> T:
    """Decode with a prebuilt decoder; schema problems become :class:`DecodeError`."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise DecodeError(str(exc)) from exc
