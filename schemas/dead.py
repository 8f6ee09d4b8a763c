"""Dead-letter records on ``nexus.dead.<stream>.<tenant>`` (stream DEAD)."""

from __future__ import annotations

import msgspec


class DeadLetter(msgspec.Struct, frozen=True):
    """A message that will never be processed, with why. ``payload`` is the original bytes
    (possibly truncated to ``payload_truncated_at``) so an operator can inspect or replay it."""

    stream: str
    subject: str
    consumer: str
    stream_seq: int
    num_delivered: int
    reason: str
    error_type: str
    payload: bytes
    at: float
    tenant: str = "unknown"
    payload_truncated_at: int = 0


DEAD_LETTER_DECODER = msgspec.msgpack.Decoder(DeadLetter)
