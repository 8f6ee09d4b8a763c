"""A set of durables, one per key (the trainer's per-tenant consumers), discovered from a
stream's subjects as keys appear, each fetched with its own prefetch through the one consume
runtime (:class:`bus.consume.Consumer`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from bus.consume import Consumer
from bus.durable import ConsumerSpec, DeadHook, Durable

log = logging.getLogger(__name__)
#: How long a fetch waits for messages the server reported pending.
BACKLOG_WAIT_S = 0.05


@dataclass
class DurableSet:
    """One durable per key (the trainer's per-tenant consumers), discovered from the stream's
    subjects as keys appear, each with its own prefetch.

    Discovery reads the stream's per-subject message counts (one request for all keys); a key
    whose last fetch came back empty is not fetched again until discovery sees messages on
    its subject that it has not fetched, so idle tenants cost nothing per round."""

    consumer: Consumer
    stream: str
    #: Subjects to discover keys from (e.g. ``nexus.train.<backbone>.>``).
    subject_filter: str
    #: The key's consumer spec, from the key (e.g. the tenant).
    spec_for: Callable[[str], ConsumerSpec]
    #: The key a subject belongs to (None: not ours).
    key_of: Callable[[str], str | None]
    on_dead: DeadHook | None = None
    durables: dict[str, Durable] = field(default_factory=dict)
    #: Keys with messages to fetch (last fetch was non-empty, or discovery saw more).
    active: set[str] = field(default_factory=set)
    #: Messages the server said were still pending after each key's last fetch that got any
    #: (``num_pending`` of its last message): those are stored, so a fetch of them may wait
    #: for them to arrive however short the caller's timeout.
    backlog: dict[str, int] = field(default_factory=dict)
    #: The last :meth:`fill` fetched from a key with a backlog (worth fetching again at once;
    #: a key the caller wants nothing of, its buffer full, does not count).
    backlog_fetched: bool = False
    #: Fetch requests made so far (one per key fetched from): idle keys must not add any.
    fetches: int = 0

    async def discover(self) -> list[str]:
        """Bind durables for new keys; mark keys with unfetched messages active. Returns the
        newly bound keys."""
        try:
            info = await self.consumer.js.stream_info(
                self.stream, subjects_filter=self.subject_filter
            )
        except NotFoundError:
            return []
        except (NatsError, TimeoutError) as exc:
            log.warning("discovery on %s failed: %s", self.stream, exc)
            return []
        new = []
        for subject, count in (info.state.subjects or {}).items():
            key = self.key_of(subject)
            if key is None:
                continue
            if key not in self.durables:
                try:
                    bound = await self.consumer.bind(self.spec_for(key), self.on_dead)
                except (NatsError, TimeoutError) as exc:  # the next discovery tries again
                    log.warning("binding %s on %s failed: %s", key, self.stream, exc)
                    continue
                except RuntimeError as exc:  # another consumer holds its subject: the
                    # operator's to remove; the other keys are served meanwhile
                    log.error("%s is not served: %s", key, exc)
                    continue
                self.durables[key] = bound
                new.append(key)
            if count > self.consumer.unsettled(self.durables[key].name):
                self.active.add(key)
        return new

    async def fill(
        self,
        wants: dict[str, int],
        timeout: float,
        also: Collection[str] = (),
        *,
        count_crashes: bool = True,
    ) -> dict[str, list[Msg]]:
        """Fetch up to ``wants[key]`` messages for every active key and every key in ``also``
        (keys expecting work, such as tenants with a live job), concurrently; redeliveries
        are counted in the crash ledger unless ``count_crashes`` is False (the caller counts
        each when its handling starts: :meth:`bus.consume.Consumer.begin_redelivered`)."""
        keys = [
            k
            for k, n in wants.items()
            if n > 0 and k in self.durables and (k in self.active or k in also)
        ]

        async def one(key: str) -> list[Msg]:
            # Messages known to be stored are worth a longer wait: a short one can end before
            # large ones have crossed the connection, and the next round would idle.
            waits = max(timeout, BACKLOG_WAIT_S) if self.backlog.get(key, 0) > 0 else timeout
            msgs = await self.consumer.fetch(
                self.durables[key], wants[key], waits, count_crashes=count_crashes
            )
            if msgs:
                self.backlog[key] = msgs[-1].metadata.num_pending
            elif waits >= BACKLOG_WAIT_S:
                self.backlog.pop(key, None)
            if len(msgs) < wants[key] and (not msgs or msgs[-1].metadata.num_pending == 0):
                self.active.discard(key)
            return msgs

        self.fetches += len(keys)
        results = await asyncio.gather(*(one(k) for k in keys))
        self.backlog_fetched = any(self.backlog.get(k, 0) > 0 for k in keys)
        return dict(zip(keys, results, strict=True))
