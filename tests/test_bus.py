"""The bus against a real nats-server: declare, dedupe, the consume loop's fates, tracing,
and the embedded server's crash/restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StreamConfig
from opentelemetry import trace

from bus import tracing
from bus.codec import decode
from bus.connect import connect
from bus.consume import PullConsumer
from bus.declare import BusLayout, DeclareConflict, declare
from bus.errors import PoisonError, RetryableError
from bus.publish import Outgoing, publish, publish_all
from bus.server import EmbeddedServer, ServerError
from schemas import subjects
from schemas.dead import DEAD_LETTER_DECODER, DeadLetter
from schemas.events import Accepted
from tests.helpers import eventually, uid


async def test_declare_is_idempotent(fresh_server: EmbeddedServer) -> None:
    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()
        first = await declare(js)
        assert "stream TRAIN" in first.created and "kv heartbeats" in first.created
        assert "object store checkpoints" in first.created
        second = await declare(js)
        assert second.created == []
        assert len(second.existing) == len(first.created)
    finally:
        await nc.close()


async def test_declare_reports_conflicting_stream_instead_of_replacing(
    fresh_server: EmbeddedServer,
) -> None:
    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name="TRAIN", subjects=["nexus.train.>"], retention=RetentionPolicy.LIMITS)
        )
        await js.publish("nexus.train.tiny.acme", b"accepted work")
        with pytest.raises(
            DeclareConflict,
            match=r"stream TRAIN exists with other settings: "
            r"retention",
        ):
            await declare(js)
        info = await js.stream_info("TRAIN")
        assert info.state.messages == 1  # nothing was replaced or dropped
    finally:
        await nc.close()


async def test_same_msg_id_is_stored_once(js: JetStreamContext) -> None:
    tenant = uid("dedupe")
    subject = subjects.event(tenant, "j1", "accepted")
    event = Accepted(tenant, "j1", "sft", 1.0)
    first = await publish(js, subject, event, message_id=f"{tenant}:1")
    second = await publish(js, subject, event, message_id=f"{tenant}:1")
    assert not first.duplicate and second.duplicate
    info = await js.stream_info(subjects.STREAM_EVENTS, subjects_filter=subject)
    assert info.state.subjects == {subject: 1}


async def test_publish_all_keeps_order_and_dedupes(js: JetStreamContext) -> None:
    tenant = uid("batch")
    items = [
        Outgoing(
            subjects.event(tenant, "j", "accepted"),
            Accepted(tenant, "j", "sft", i),
            message_id=f"{tenant}:{i % 5}",
        )
        for i in range(20)
    ]
    acks = await publish_all(js, items)
    assert len(acks) == 20 and sum(not a.duplicate for a in acks) == 5


async def _run_consumer(consumer: PullConsumer, until: asyncio.Event) -> asyncio.Task[None]:
    return asyncio.create_task(consumer.run(until))


async def _dead_letters(js: JetStreamContext, tenant: str) -> list[DeadLetter]:
    sub = await js.subscribe(subjects.dead("TRAIN", tenant), ordered_consumer=True)
    found = []
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            found.append(decode(DEAD_LETTER_DECODER, msg.data))
    except NatsError:  # nats TimeoutError: no more records
        return found
    finally:
        await sub.unsubscribe()


async def test_poison_goes_to_dead_with_reason_and_consumer_continues(
    js: JetStreamContext,
) -> None:
    tenant = uid("poison")
    handled: list[bytes] = []
    told: list[str] = []

    async def handler(msg: Msg) -> None:
        if msg.data == b"bad":
            raise PoisonError("tensor shape (3,) does not match action_dim 7")
        handled.append(msg.data)

    async def on_dead(msg: Msg, reason: str, error: BaseException) -> None:
        told.append(reason)

    stop = asyncio.Event()
    consumer = PullConsumer(
        js,
        stream="TRAIN",
        durable=uid("c"),
        filter_subject=subjects.train("tiny", tenant),
        handler=handler,
        on_dead=on_dead,
    )
    task = await _run_consumer(consumer, stop)
    for payload in (b"good-1", b"bad", b"good-2"):
        await js.publish(subjects.train("tiny", tenant), payload)
    await eventually(lambda: len(handled) == 2, what="both good messages handled")
    dead = await eventually(lambda: _dead_letters(js, tenant), what="dead letter")
    assert dead[0].payload == b"bad" and dead[0].tenant == tenant
    assert dead[0].reason == "tensor shape (3,) does not match action_dim 7"
    assert told == [dead[0].reason]
    stop.set()
    await task
    info = await js.consumer_info("TRAIN", consumer.durable)
    assert info.num_pending == 0 and info.num_ack_pending == 0


async def test_retryable_error_is_redelivered_then_succeeds(js: JetStreamContext) -> None:
    tenant = uid("retry")
    attempts: list[int] = []

    async def handler(msg: Msg) -> None:
        attempts.append(msg.metadata.num_delivered)
        if len(attempts) < 3:
            raise RetryableError("trainer slot not ready", delay_s=0.05)

    stop = asyncio.Event()
    consumer = PullConsumer(
        js,
        stream="TRAIN",
        durable=uid("c"),
        filter_subject=subjects.train("tiny", tenant),
        handler=handler,
    )
    task = await _run_consumer(consumer, stop)
    await js.publish(subjects.train("tiny", tenant), b"x")
    await eventually(lambda: len(attempts) == 3, what="three deliveries")
    assert attempts == [1, 2, 3]
    stop.set()
    await task
    assert await _dead_letters(js, tenant) == []


async def test_unexpected_errors_end_in_dead_after_max_deliver(js: JetStreamContext) -> None:
    tenant = uid("bug")

    async def handler(msg: Msg) -> None:
        raise ZeroDivisionError("a bug of ours")

    stop = asyncio.Event()
    consumer = PullConsumer(
        js,
        stream="TRAIN",
        durable=uid("c"),
        max_deliver=2,
        filter_subject=subjects.train("tiny", tenant),
        handler=handler,
    )
    task = await _run_consumer(consumer, stop)
    await js.publish(subjects.train("tiny", tenant), b"x")
    dead = await eventually(lambda: _dead_letters(js, tenant), timeout=15, what="dead letter")
    assert dead[0].reason == "gave up after 2 deliveries: ZeroDivisionError: a bug of ours"
    stop.set()
    await task


async def test_long_work_sends_in_progress_acks(js: JetStreamContext) -> None:
    tenant = uid("long")
    deliveries: list[int] = []

    async def handler(msg: Msg) -> None:
        deliveries.append(msg.metadata.num_delivered)
        await asyncio.sleep(2.5)  # the work itself: longer than ack_wait

    stop = asyncio.Event()
    consumer = PullConsumer(
        js,
        stream="TRAIN",
        durable=uid("c"),
        ack_wait_s=1.0,
        filter_subject=subjects.train("tiny", tenant),
        handler=handler,
    )
    task = await _run_consumer(consumer, stop)
    await js.publish(subjects.train("tiny", tenant), b"x")
    await eventually(lambda: deliveries, what="delivery")
    info = await eventually(
        lambda: _acked(js, consumer.durable), timeout=10, what="ack after long work"
    )
    assert info and deliveries == [1]
    stop.set()
    await task


async def _acked(js: JetStreamContext, durable: str) -> bool:
    info = await js.consumer_info("TRAIN", durable)
    return info.ack_floor.stream_seq > 0 and info.num_ack_pending == 0


async def test_trace_context_travels_in_headers(js: JetStreamContext) -> None:
    tracing.setup_tracing("pytest")
    tenant = uid("trace")
    seen: list[int] = []

    async def handler(msg: Msg) -> None:
        seen.append(trace.get_current_span().get_span_context().trace_id)

    with tracing.tracer().start_as_current_span("submit") as span:
        sent_trace = span.get_span_context().trace_id
        await publish(js, subjects.train("tiny", tenant), Accepted(tenant, "j", "sft", 1.0))
    stop = asyncio.Event()
    consumer = PullConsumer(
        js,
        stream="TRAIN",
        durable=uid("c"),
        filter_subject=subjects.train("tiny", tenant),
        handler=handler,
    )
    task = await _run_consumer(consumer, stop)
    await eventually(lambda: seen, what="handled")
    assert seen == [sent_trace] and sent_trace != 0
    stop.set()
    await task


def test_embedded_server_reports_fatal_start_errors(tmp_path: Path) -> None:
    with EmbeddedServer(tmp_path / "a") as running:
        clash = EmbeddedServer(tmp_path / "b", port=running.port)
        with pytest.raises(ServerError, match="exited with"):
            clash.start(timeout=5)


async def test_kill_and_restart_on_same_store_keeps_unacked_work(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "nats").start()
    try:
        nc = await connect(server.url)
        js = nc.jetstream()
        await declare(js, BusLayout())
        for i in range(5):
            await js.publish("nexus.train.tiny.acme", f"step-{i}".encode())
        port = server.port
        server.kill()
        server.restart()
        assert server.port == port
        info = await eventually(
            lambda: _stream_messages(js, "TRAIN"), timeout=15, what="stream back after restart"
        )
        assert info == 5
        await nc.close()
    finally:
        server.kill()


async def _stream_messages(js: JetStreamContext, name: str) -> int | None:
    try:
        return (await js.stream_info(name)).state.messages
    except NatsError:  # reconnecting
        return None
