"""Following a KV bucket until the service stops, without ever cancelling a nats.py call.

nats.py's ``watchall()`` and its ``updates()`` use ``asyncio.wait_for`` inside, which on
Python 3.11 can swallow a cancel (PITFALLS): a follower stopped by ``task.cancel()`` may never
return. :func:`follow_kv` instead polls ``updates()`` with a short timeout and checks the stop
event between polls; a stop during the watch's set-up leaves the set-up to finish on its own
and stops the watcher it returns, so no subscription is leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable

from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

log = logging.getLogger(__name__)

#: How often a follower looks at the stop event while the bucket is quiet.
POLL_S = 0.25

#: Watchers being stopped after a stop during their set-up (kept referenced until done).
_stopping: set[asyncio.Future[None]] = set()

EntryHandler = Callable[[KeyValue.Entry], Awaitable[None] | None]


async def _stop_watcher(watcher: KeyValue.KeyWatcher) -> None:
    with contextlib.suppress(NatsError, TimeoutError, OSError):
        await asyncio.wait_for(watcher.stop(), 0.5)


def _stop_when_ready(setup: asyncio.Future[KeyValue.KeyWatcher]) -> None:
    def done(fut: asyncio.Future[KeyValue.KeyWatcher]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            task = asyncio.ensure_future(_stop_watcher(fut.result()))
            _stopping.add(task)
            task.add_done_callback(_stopping.discard)

    setup.add_done_callback(done)


async def _delivered_nothing(watcher: KeyValue.KeyWatcher) -> bool | None:
    """Whether the watch's consumer has delivered nothing and has nothing pending: its
    bucket was empty (None: its info could not be read). nats.py's end-of-entries marker
    alone does not say so: it is queued when the consumer's info shows nothing pending and
    nothing received yet, which is also the case while the first entries are still on their
    way to the watch's callback (seen on a 300-key bucket in one watch of ten), so the
    marker can come before every entry."""
    sub = watcher._sub
    if sub is None:
        return True
    try:
        info = await sub.consumer_info()
    except (NatsError, TimeoutError) as exc:
        log.info("watch consumer info not read (%s); asking again", exc)
        return None
    return info.num_pending == 0 and info.delivered.consumer_seq == 0


def _reconnects(kv: KeyValue) -> int:
    """How many times the bucket's connection has reconnected."""
    return int(kv._js._nc.stats["reconnects"])


async def follow_kv(
    kv: KeyValue,
    stop: asyncio.Event,
    on_entry: EntryHandler,
    *,
    on_ready: Callable[[], None] | None = None,
    retry_s: float = 0.5,
) -> None:
    """Call ``on_entry`` for every current and future entry of ``kv`` until ``stop`` is set.
    ``on_ready`` runs once the bucket's current entries have been handled (once per watch
    started: a watch started again replays them and says so again). A failed watch is
    started again (it replays the latest entries), and so is a watch that lived through a
    reconnect: after a broker restart its consumer may be gone, and it would wait silently
    for updates that never come."""
    while not stop.is_set():
        reconnects = _reconnects(kv)
        setup = asyncio.ensure_future(kv.watchall())
        while not setup.done() and not stop.is_set():
            await asyncio.wait({setup}, timeout=POLL_S)
        if not setup.done():
            _stop_when_ready(setup)
            return
        try:
            watcher = setup.result()
        except (NatsError, TimeoutError, OSError) as exc:
            log.warning("watch on %s failed to start (%s); trying again", kv._name, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), retry_s)
            continue
        handled = 0
        told = False
        ask_again = False  # the end marker came and the consumer's info was not read

        def ready() -> None:
            nonlocal told
            if not told and on_ready is not None:
                told = True
                on_ready()

        try:
            while not stop.is_set():
                if _reconnects(kv) != reconnects:
                    log.info("watch on %s outlived a reconnect; starting it again", kv._name)
                    break
                try:
                    entry = await watcher.updates(timeout=POLL_S)
                except (NatsError, TimeoutError):  # nats' TimeoutError: nothing new
                    if not ask_again or handled:
                        continue
                    entry = None  # the marker's question, asked again
                if entry is None:  # nats.py's "end of the current entries" marker
                    if not handled:
                        empty = await _delivered_nothing(watcher)
                        ask_again = empty is None
                        if empty:
                            ready()  # an empty bucket: no entry will say so
                    continue
                handled += 1
                result = on_entry(entry)
                if inspect.isawaitable(result):
                    await result
                if entry.delta == 0:  # nothing more was pending: the current entries are in
                    ready()
        finally:
            await _stop_watcher(watcher)
