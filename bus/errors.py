"""Errors that carry their retry decision.

Handlers raise these; the consume loop (:mod:`bus.consume`) is the one place that maps them
to ack / nak-with-delay / term + dead-letter. Any other exception escaping a handler is a bug
in our code, treated as retryable with backoff until ``max_deliver`` sends it to ``DEAD``.
"""

from __future__ import annotations


class HandlerError(Exception):
    """Base of handler errors. ``retryable`` decides redelivery; ``delay_s`` the nak delay."""

    retryable: bool = True

    def __init__(self, message: str, *, retryable: bool | None = None, delay_s: float = 1.0):
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable
        self.delay_s = delay_s


class RetryableError(HandlerError):
    """A transient failure (dependency not ready, resource busy): redeliver after a delay."""

    retryable = True


class PoisonError(HandlerError):
    """The message can never succeed (bad schema, bad tensor shape, unknown tenant):
    terminate it, dead-letter it with the reason, tell the tenant."""

    retryable = False


class Interrupted(HandlerError):
    """The service is stopping before the handler finished: hand the message back at once
    (nak without delay) for another instance."""

    retryable = True

    def __init__(self, message: str = "service stopping") -> None:
        super().__init__(message, delay_s=0.0)
