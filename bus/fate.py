"""What a consumed message's fate can be, and how it is decided: the vocabulary of
:meth:`bus.consume.Consumer.settle` (the only place that carries a fate out). A handler
returns None or :data:`HOLD`, or raises; :func:`retry_decision` reads a raised error;
:func:`dead_letter` records a message that will not be delivered again."""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.codec import DecodeError, encode
from bus.errors import HandlerError
from schemas import subjects
from schemas.dead import DeadLetter
from schemas.headers import MSG_ID

#: Dead letters keep at most this many payload bytes (the rest is in the source stream's
#: history only for limits streams; for work queues it is gone, so keep a generous slice).
DEAD_PAYLOAD_LIMIT = 512 * 1024


class Hold:
    """Returned by a handler whose message's effect is not durable yet (the trainer applied a
    batch that the next checkpoint will contain). The runtime keeps the message alive until
    :meth:`Consumer.release` settles it."""

    def __repr__(self) -> str:
        return "HOLD"


HOLD = Hold()

Handler = Callable[[Msg], Awaitable[Hold | None]]


class Fate(enum.Enum):
    ACKED = "acked"
    RETRY = "retry"
    DEAD = "dead"
    HELD = "held"
    HANDED_BACK = "handed back"


def error_reason(error: BaseException) -> str:
    """What the sender is told: our own errors speak for themselves; others name their type."""
    if isinstance(error, HandlerError | DecodeError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _tenant_of(msg: Msg) -> str:
    tenant = subjects.tenant_of(msg.subject)
    try:
        return subjects.validate_id(tenant or "", "tenant")
    except ValueError:
        return "unknown"


def retry_decision(error: BaseException, delivered: int) -> tuple[bool, float]:
    """(retryable, nak delay) for ``error`` on its ``delivered``-th delivery."""
    if isinstance(error, HandlerError | DecodeError):
        retryable = isinstance(error, HandlerError) and error.retryable
        delay = error.delay_s if isinstance(error, HandlerError) else 0.0
        return retryable, delay
    return True, min(30.0, 0.5 * 2 ** (delivered - 1))


async def dead_letter(
    js: JetStreamContext, msg: Msg, *, consumer: str, reason: str, error_type: str
) -> None:
    """Publish a :class:`DeadLetter` for ``msg`` (idempotent per stream sequence)."""
    meta = msg.metadata
    stream = meta.stream
    payload = msg.data or b""
    record = DeadLetter(
        stream=stream,
        subject=msg.subject,
        consumer=consumer,
        stream_seq=meta.sequence.stream,
        num_delivered=meta.num_delivered,
        reason=reason,
        error_type=error_type,
        payload=payload[:DEAD_PAYLOAD_LIMIT],
        at=time.time(),
        tenant=_tenant_of(msg),
        payload_truncated_at=DEAD_PAYLOAD_LIMIT if len(payload) > DEAD_PAYLOAD_LIMIT else 0,
    )
    await js.publish(
        subjects.dead(stream, record.tenant),
        encode(record),
        headers={MSG_ID: f"dead:{stream}:{record.stream_seq}"},
    )
