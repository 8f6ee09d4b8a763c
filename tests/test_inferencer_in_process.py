"""The inferencer in this process, so that its checkpoint reads can be held and its answers
made to fail.

* One job's slow policy load holds up only that job's requests. An admission waiting on its
  policy's checkpoint read (a cold start, an evicted job, a slow object store: up to
  ``--checkpoint-read-s``) took a place in the pull room; enough of one job's requests filled
  it, and no other tenant's request was pulled until the load ended. Then the places beyond
  the room filled the same way under a flood: one job now takes all but the places kept for
  other jobs' loads, and its further requests come back later (answered "ask again",
  retryable, at their last delivery).
* An answer that fails before it settles its request (an encode error, a bug) leaves the
  request to the runtime's decision (redelivered), not held and kept alive for good."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import pytest
from nats.js.object_store import ObjectStore

import bus.service
from bus import checkpoints as ckpt
from bus.connect import connect
from bus.declare import declare
from bus.inference import InferenceError, PolicyClient
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.infer import ActReply
from services.inferencer.config import InferencerConfig
from services.inferencer.service import run
from tests.helpers import dead_letters, uid
from tests.test_inferencer import FLOW, commit_policy, make_obs
from vla.backbone import Backbone


@pytest.fixture
def no_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process the stop watchdog would end pytest itself on a hung stop."""
    monkeypatch.setattr(
        bus.service, "_arm_watchdog", lambda role: threading.Timer(3600, lambda: None)
    )


@pytest.mark.timeout(120)
async def test_a_slow_policy_load_does_not_stop_the_pulls_for_other_jobs(
    fresh_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch, no_watchdog: None
) -> None:
    bid, slow, quick = uid("loads"), uid("slow"), uid("quick")
    other, third = uid("other"), uid("third")
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    hidden = Backbone.load("tiny").hidden_size
    for tenant in (slow, other, third, quick):
        await commit_policy(js, tenant, "job", FLOW, hidden)
    real_read = ckpt.get_checkpoint
    reading = {tenant: asyncio.Event() for tenant in (slow, other, third)}
    release = asyncio.Event()

    async def held_read(store: ObjectStore, name: str, sha256: str, *args: Any) -> bytes:
        tenant = name.split("/")[0]
        if tenant in reading:
            reading[tenant].set()
            await asyncio.wait_for(release.wait(), 60)
        return await real_read(store, name, sha256, *args)

    monkeypatch.setattr(ckpt, "get_checkpoint", held_read)
    # target_batch 2: a pull room of 4 requests, and 16 places beyond it for admissions that
    # wait on a load, the last 4 of them kept for other jobs (each taking at most half of
    # those left). 30 of the slow job's would fill both.
    config = InferencerConfig(
        url=fresh_server.url, instance=uid("inf"), backbone_id=bid, target_batch=2
    )
    flood = 30
    service = asyncio.create_task(run(config))
    try:
        async with await PolicyClient.create(nc, bid, js) as client:
            first = await client.act(quick, "job", [make_obs(FLOW, 0)], timeout=60)
            assert first.error == "", first.error
            held = [
                asyncio.create_task(client.act(slow, "job", [make_obs(FLOW, i)], timeout=60))
                for i in range(flood)
            ]
            await asyncio.wait_for(reading[slow].wait(), 30)
            # Its load is held: the other tenant's request is pulled and served meanwhile.
            served = await client.act(quick, "job", [make_obs(FLOW, 99)], timeout=5)
            assert served.error == "" and served.actions is not None, served.error
            # The slow job's requests past the places left to others are told to ask again.
            done, _ = await asyncio.wait(held, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            assert done, "no request of the flood was answered while its load was held"
            busy = next(iter(done)).exception()
            assert isinstance(busy, InferenceError) and busy.retryable, busy
            assert "is not loaded here" in str(busy) and "kept for other jobs" in str(busy), busy
            # Two more jobs whose policies load slowly too: the first floods as well and
            # takes half of the places left, the second still finds one.
            second_flood = [
                asyncio.create_task(client.act(other, "job", [make_obs(FLOW, i)], timeout=60))
                for i in range(5)
            ]
            await asyncio.wait_for(reading[other].wait(), 30)
            waits = asyncio.create_task(client.act(third, "job", [make_obs(FLOW, 7)], timeout=60))
            await asyncio.wait_for(reading[third].wait(), 30)
            release.set()
            waited = await waits
            assert waited.error == "" and waited.actions is not None, waited.error
            others = await asyncio.gather(*second_flood, return_exceptions=True)
            assert any(isinstance(r, ActReply) for r in others), others
            results = await asyncio.gather(*held, return_exceptions=True)
            answered = [r for r in results if isinstance(r, ActReply)]
            refused = [r for r in results if not isinstance(r, ActReply)]
            for reply in answered:
                assert reply.error == "" and reply.actions is not None, reply.error
            for error in refused:
                assert isinstance(error, InferenceError) and error.retryable, error
                assert "ask again" in str(error), error
            # All but the 4 places kept for others (of which it takes half) waited and were
            # served.
            assert len(answered) >= 12 and refused, (len(answered), len(refused))
            # Turned away, not failed: no dead letter for each request of the flood.
            assert await dead_letters(js, subjects.STREAM_INFER, slow) == []
    finally:
        release.set()
        os.kill(os.getpid(), signal.SIGTERM)  # serve()'s handler: its loop is this one
        await asyncio.wait({service}, timeout=10)
        await nc.close()
    assert service.done()
    service.result()


@pytest.mark.timeout(120)
async def test_an_answer_that_fails_before_it_settles_its_request_is_redelivered(
    fresh_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch, no_watchdog: None
) -> None:
    from services.inferencer.replies import Replies

    bid, tenant = uid("answers"), uid("t")
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    await commit_policy(js, tenant, "job", FLOW, Backbone.load("tiny").hidden_size)
    real_answer = Replies.answer
    failed: list[str] = []

    async def fails_once(self: Replies, pending: Any, outcome: Any) -> None:
        if not failed:
            failed.append(pending.work.request.request_id)
            raise RuntimeError("answer broke before its settle")
        await real_answer(self, pending, outcome)

    monkeypatch.setattr(Replies, "answer", fails_once)
    config = InferencerConfig(url=fresh_server.url, instance=uid("inf"), backbone_id=bid)
    service = asyncio.create_task(run(config))
    try:
        async with await PolicyClient.create(nc, bid, js) as client:
            reply = await client.act(tenant, "job", [make_obs(FLOW, 0)], timeout=60)
            assert reply.error == "" and reply.actions is not None, reply.error
            assert len(failed) == 1
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait({service}, timeout=10)
        await nc.close()
    assert service.done()
    service.result()
