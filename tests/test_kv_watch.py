""":func:`bus.watch.follow_kv` says a bucket's current entries are in only once they are.

nats.py queues its end-of-entries marker when the watch consumer's info shows nothing pending
and nothing received, which is also the case while the first entries are still on their way
to the watch's callback: on a 300-key bucket, one watch start in ten said "ready" with none
of its entries handled. The inferencer answers act requests from what its watch has seen
once it is ready."""

from __future__ import annotations

import asyncio

import pytest

from bus.connect import connect
from bus.server import EmbeddedServer
from bus.watch import follow_kv

KEYS = 300
WATCHES = 40


@pytest.mark.timeout(120)
async def test_a_watch_is_ready_only_after_every_current_entry(
    fresh_server: EmbeddedServer,
) -> None:
    nc = await connect(fresh_server.url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="watched")
        await asyncio.gather(*(kv.put(f"k{i}", b"x" * 200) for i in range(KEYS)))
        seen_at_ready = []
        for _ in range(WATCHES):
            stop, ready = asyncio.Event(), asyncio.Event()
            seen: set[str] = set()

            def on_ready(seen: set[str] = seen, ready: asyncio.Event = ready) -> None:
                seen_at_ready.append(len(seen))
                ready.set()

            follower = asyncio.create_task(
                follow_kv(kv, stop, lambda e, seen=seen: seen.add(e.key), on_ready=on_ready)
            )
            await asyncio.wait_for(ready.wait(), 20)
            stop.set()
            await asyncio.wait_for(follower, 5)
        assert seen_at_ready == [KEYS] * WATCHES
    finally:
        await nc.close()


async def ready_on_an_empty_bucket(url: str) -> None:
    """A watch of an empty bucket says "ready" within 10 s (then it is stopped)."""
    nc = await connect(url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="empty")
        stop, ready = asyncio.Event(), asyncio.Event()
        follower = asyncio.create_task(follow_kv(kv, stop, lambda e: None, on_ready=ready.set))
        await asyncio.wait_for(ready.wait(), 10)
        stop.set()
        await asyncio.wait_for(follower, 5)
    finally:
        await nc.close()


@pytest.mark.timeout(60)
async def test_a_watch_of_an_empty_bucket_is_ready_at_once(fresh_server: EmbeddedServer) -> None:
    await ready_on_an_empty_bucket(fresh_server.url)


@pytest.mark.timeout(60)
async def test_a_watch_of_an_empty_bucket_asks_again_when_its_consumer_info_fails(
    fresh_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end marker of an empty bucket says nothing by itself; the consumer's info does.
    When that info cannot be read (an API timeout on a loaded server), the watch asks again
    instead of never being ready."""
    from nats.js.client import JetStreamContext

    real = JetStreamContext.PushSubscription.consumer_info
    calls: list[int] = []
    failures: list[int] = []

    async def flaky(self: JetStreamContext.PushSubscription) -> object:
        calls.append(1)
        # The first call is nats.py's own, setting the watch up; the next two are the
        # follower's question after the end marker.
        if len(calls) in (2, 3):
            failures.append(1)
            raise TimeoutError("consumer info timed out")
        return await real(self)

    monkeypatch.setattr(JetStreamContext.PushSubscription, "consumer_info", flaky)
    await ready_on_an_empty_bucket(fresh_server.url)
    assert len(failures) == 2
