"""A durable pull consumer: what it is (:class:`ConsumerSpec`: stream, name, filters,
delivery settings) and what binding it gives (:class:`Durable`: the spec, its pull
subscription and its dead-letter hook). :mod:`bus.consume` binds, fetches and settles them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

#: Deliveries the server allows beyond a consumer's ``max_deliver``: every nak counts as a
#: delivery, and a message handed back by stopping instances (``Interrupted``) must still be
#: delivered again; the runtime dead-letters failing messages by its own count.
HAND_BACK_ALLOWANCE = 20

#: Told of every message the runtime dead-letters: (message, reason, error).
DeadHook = Callable[[Msg, str, BaseException], Awaitable[None]]


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer's identity and delivery settings."""

    stream: str
    durable: str
    #: The subject filter, or several: the consumer then gets only messages on those (a
    #: role that would ignore most of a stream does not fetch and ack them at all).
    filter_subject: str | tuple[str, ...]
    #: Redelivery after this long without an ack or in-progress ack.
    ack_wait_s: float = 30.0
    #: Deliveries before a retried message is dead-lettered (decided by the runtime; the
    #: server allows :data:`HAND_BACK_ALLOWANCE` more, for work handed back at stops).
    max_deliver: int = 5
    #: Unacked messages the server lets this consumer have at once.
    max_ack_pending: int = 1000
    #: Redeliveries in a row whose handling started and never settled (the role died while
    #: handling them) before the message is dead-lettered unhandled (:mod:`bus.crashes`);
    #: 0: ``max_deliver``.
    max_crashes: int = 0

    @property
    def crash_limit(self) -> int:
        return self.max_crashes or self.max_deliver

    @property
    def filters(self) -> tuple[str, ...]:
        """Every subject filter, however given."""
        f = self.filter_subject
        return (f,) if isinstance(f, str) else f

    def config(self) -> ConsumerConfig:
        one = len(self.filters) == 1
        return ConsumerConfig(
            durable_name=self.durable,
            filter_subject=self.filters[0] if one else None,
            filter_subjects=None if one else list(self.filters),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver + HAND_BACK_ALLOWANCE if self.max_deliver > 0 else -1,
            max_ack_pending=self.max_ack_pending,
        )


def config_filters(config: ConsumerConfig) -> set[str]:
    """The subject filters a consumer's config names, however given."""
    one = [config.filter_subject] if config.filter_subject else []
    return {*(config.filter_subjects or ()), *one}


def config_differs(found: ConsumerConfig, wanted: ConsumerConfig) -> list[str]:
    """What of ``wanted`` (filters and delivery settings) the existing consumer's ``found``
    config does not have: those are updated at bind, or a role started with another
    ``--ack-wait-s`` would keep the old one (its in-progress acks then too rare: running
    tasks delivered twice) and another ``--max-deliver`` would do nothing."""
    differs = []
    if config_filters(found) != config_filters(wanted):
        differs.append("filters")
    # The server keeps durations in nanoseconds, nats.py gives them back in seconds.
    if abs((found.ack_wait or 0.0) - (wanted.ack_wait or 0.0)) > 1e-6:
        differs.append("ack_wait")
    for name in ("max_deliver", "max_ack_pending"):
        if getattr(found, name) != getattr(wanted, name):
            differs.append(name)
    return differs


@dataclass
class Durable:
    """A bound durable: its spec, pull subscription and the hook told of its dead letters."""

    spec: ConsumerSpec
    sub: JetStreamContext.PullSubscription
    on_dead: DeadHook | None = None
    #: Messages of this durable being handled right now.
    in_flight: int = 0
    #: When its last fetch returned (monotonic); see :data:`bus.consume.LATE_DELIVERY_S`.
    fetched_at: float = 0.0

    def take_late(self) -> list[Msg]:
        """Messages delivered to this subscription after its last fetch returned (answers to
        a pull request that expired as the fetch timed out); status messages are dropped.
        nats.py keeps them in the subscription's queue for the next fetch and has no public
        call that takes them without asking the server for more, hence its queue here."""
        queue = self.sub._sub._pending_queue
        late: list[Msg] = []
        while not queue.empty():
            msg = queue.get_nowait()
            self.sub._sub._pending_size -= len(msg.data)
            if not JetStreamContext.is_status_msg(msg):
                late.append(msg)
        return late

    @property
    def name(self) -> str:
        return self.spec.durable
