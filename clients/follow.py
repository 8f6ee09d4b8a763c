"""Following one job's events: pages read from the master, woken by the live events.

A tenant's identity has no JetStream (:mod:`schemas.tenantctl` says why), so it cannot make a
consumer on ``EVENTS``. It asks the master for the job's events after the last stream
sequence it has (:class:`~schemas.tenantctl.ReadEvents`), which gives every event once, in
stream order, across reconnects and master restarts. To learn when to ask again without
polling hard, it also subscribes to the job's event subject (core NATS, which its identity
may): a live event only wakes the follower; what it returns always comes from a page.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from clients.errors import RequestError
from schemas import subjects
from schemas.tenantctl import EventsPage, ReadEvents, StoredEvent

#: Asks the master one :class:`ReadEvents` within a timeout (seconds); raises
#: :class:`~clients.errors.RequestError` on failure.
AskEvents = Callable[[ReadEvents, float], Awaitable[EventsPage]]
#: The longest one page request may take.
ASK_TIMEOUT_S = 10.0
#: The least time between two page requests: a job reporting every few milliseconds (an SFT
#: step's progress) is read a page of many events at a time, not a request per event, which
#: would spend the tenant's request rate (the master paces each tenant) on its own events.
MIN_ASK_INTERVAL_S = 0.1


class EventFollower:
    """One job's events from the first, in order, each once.

    ``ask`` sends one :class:`ReadEvents` to the master (:meth:`clients.sdk.Client.request`).
    Without a live event it asks again every ``poll_s`` (events published while its
    subscription was away, e.g. across a reconnect, are found then). A
    :class:`~clients.errors.RequestError` that is ``retryable`` (no master for a moment) is
    asked again after ``poll_s``; any other is raised.
    """

    def __init__(
        self, nc: NATS, ask: AskEvents, tenant: str, job_id: str, poll_s: float = 2.0
    ) -> None:
        self.nc = nc
        self.ask = ask
        self.tenant = tenant
        self.job_id = job_id
        self.subject = subjects.events_of_job(tenant, job_id)
        self.poll_s = poll_s
        #: Stream sequence of the last event fetched (the next page starts after it).
        self.last_seq = 0
        #: Pages asked for (for tests and diagnostics).
        self.pages = 0
        self.pending: deque[StoredEvent] = deque()
        self.woken = asyncio.Event()
        self.sub: Subscription | None = None
        self._asked_at = -MIN_ASK_INTERVAL_S

    async def _wake(self, _msg: Msg) -> None:
        self.woken.set()

    async def next(self, timeout: float) -> StoredEvent:
        """The next event; TimeoutError if none comes within ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.pending:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"no event from job {self.job_id} in {timeout:g}s")
            if self.sub is None:
                with contextlib.suppress(NatsError):
                    self.sub = await self.nc.subscribe(self.subject, cb=self._wake)
            too_soon = self._asked_at + MIN_ASK_INTERVAL_S - loop.time()
            if too_soon > 0:
                await asyncio.sleep(min(too_soon, remaining))
            # Cleared before asking: an event stored while the page is read wakes the wait.
            self.woken.clear()
            self._asked_at = loop.time()
            request = ReadEvents(self.tenant, self.job_id, self.last_seq)
            try:
                page = await self.ask(request, max(0.05, min(remaining, ASK_TIMEOUT_S)))
            except RequestError as exc:
                if not exc.retryable:
                    raise
                page = EventsPage([], self.last_seq)
            self.pages += 1
            self.pending.extend(e for e in page.events if e.seq > self.last_seq)
            if self.pending:
                self.last_seq = self.pending[-1].seq
                continue
            remaining = deadline - loop.time()
            if remaining > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.woken.wait(), min(remaining, self.poll_s))
        return self.pending.popleft()

    async def close(self) -> None:
        if self.sub is not None:
            sub, self.sub = self.sub, None
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()
