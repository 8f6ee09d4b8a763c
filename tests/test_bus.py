"""The bus against a real nats-server: declare, dedupe, the consume loop's fates, tracing,
and the embedded server's crash/restart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StreamConfig
from opentelemetry import trace

from bus import tracing
from bus.connect import connect
from bus.consume import Consumer
from bus.declare import BusLayout, DeclareConflict, declare
from bus.durable import HAND_BACK_ALLOWANCE, ConsumerSpec
from bus.durables import DurableSet
from bus.errors import Interrupted, PoisonError, RetryableError
from bus.fate import HOLD, Handler, Hold
from bus.publish import Outgoing, publish, publish_all
from bus.server import EmbeddedServer, ServerError
from bus.watch import follow_kv
from schemas import subjects
from schemas.events import Accepted
from tests.helpers import dead_letters, eventually, uid


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


async def _run_consumer(
    js: JetStreamContext,
    stop: asyncio.Event,
    tenant: str,
    handler: Handler,
    concurrency: int = 1,
    **spec: object,
) -> tuple[asyncio.Task[None], Consumer, str]:
    """A consume runtime on one durable of ``tenant``'s TRAIN subject, with its keep-alive,
    running until ``stop`` (then closed, as serve() does)."""
    consumer = Consumer(js, stop)
    on_dead = spec.pop("on_dead", None)
    durable = await consumer.bind(
        ConsumerSpec("TRAIN", uid("c"), subjects.train("tiny", tenant), **spec),  # type: ignore[arg-type]
        on_dead,  # type: ignore[arg-type]
    )

    async def run() -> None:
        await asyncio.gather(
            consumer.run(durable, handler, concurrency=concurrency), consumer.keep_alive()
        )
        await consumer.close()

    return asyncio.create_task(run()), consumer, durable.name


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
    task, _, durable = await _run_consumer(js, stop, tenant, handler, on_dead=on_dead)
    for payload in (b"good-1", b"bad", b"good-2"):
        await js.publish(subjects.train("tiny", tenant), payload)
    await eventually(lambda: len(handled) == 2, what="both good messages handled")
    dead = await eventually(lambda: dead_letters(js, "TRAIN", tenant), what="dead letter")
    assert dead[0].payload == b"bad" and dead[0].tenant == tenant
    assert dead[0].reason == "tensor shape (3,) does not match action_dim 7"
    assert told == [dead[0].reason]
    stop.set()
    await task
    await eventually(lambda: _drained(js, durable), what="nothing pending or unacked")


async def test_retryable_error_is_redelivered_then_succeeds(js: JetStreamContext) -> None:
    tenant = uid("retry")
    attempts: list[int] = []

    async def handler(msg: Msg) -> None:
        attempts.append(msg.metadata.num_delivered)
        if len(attempts) < 3:
            raise RetryableError("trainer slot not ready", delay_s=0.05)

    stop = asyncio.Event()
    task, _, _ = await _run_consumer(js, stop, tenant, handler)
    await js.publish(subjects.train("tiny", tenant), b"x")
    await eventually(lambda: len(attempts) == 3, what="three deliveries")
    assert attempts == [1, 2, 3]
    stop.set()
    await task
    assert await dead_letters(js, "TRAIN", tenant) == []


async def test_unexpected_errors_end_in_dead_after_max_deliver(js: JetStreamContext) -> None:
    tenant = uid("bug")

    async def handler(msg: Msg) -> None:
        raise ZeroDivisionError("a bug of ours")

    stop = asyncio.Event()
    task, _, _ = await _run_consumer(js, stop, tenant, handler, max_deliver=2)
    await js.publish(subjects.train("tiny", tenant), b"x")
    dead = await eventually(
        lambda: dead_letters(js, "TRAIN", tenant), timeout=15, what="dead letter"
    )
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
    task, _, durable = await _run_consumer(js, stop, tenant, handler, ack_wait_s=1.0)
    await js.publish(subjects.train("tiny", tenant), b"x")
    await eventually(lambda: deliveries, what="delivery")
    info = await eventually(lambda: _acked(js, durable), timeout=10, what="ack after long work")
    assert info and deliveries == [1]
    stop.set()
    await task


async def _drained(js: JetStreamContext, durable: str) -> bool:
    """Nothing left to deliver or to acknowledge. An ack is a publish the server applies
    after a later request may already be answered, so callers wait for this."""
    info = await js.consumer_info("TRAIN", durable)
    return info.num_pending == 0 and info.num_ack_pending == 0


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
    task, _, _ = await _run_consumer(js, stop, tenant, handler)
    await eventually(lambda: seen, what="handled")
    assert seen == [sent_trace] and sent_trace != 0
    stop.set()
    await task


async def test_held_message_stays_alive_until_released_then_is_acked(
    js: JetStreamContext,
) -> None:
    tenant = uid("hold")
    held: list[Msg] = []

    async def handler(msg: Msg) -> Hold:
        held.append(msg)
        return HOLD  # e.g. applied, waiting for the checkpoint that contains it

    stop = asyncio.Event()
    task, consumer, durable = await _run_consumer(js, stop, tenant, handler, ack_wait_s=1.0)
    await js.publish(subjects.train("tiny", tenant), b"x")
    await eventually(lambda: held, what="handled")
    await asyncio.sleep(2.5)  # longer than ack_wait: only in-progress acks keep it ours
    info = await js.consumer_info("TRAIN", durable)
    assert info.num_ack_pending == 1 and info.num_redelivered == 0 and len(held) == 1
    await consumer.release(held)
    assert await eventually(lambda: _acked(js, durable), what="acked after release")
    stop.set()
    await task


async def test_interrupted_work_is_handed_back_at_once_and_not_dead_lettered(
    js: JetStreamContext,
) -> None:
    tenant = uid("interrupt")
    deliveries: list[int] = []

    async def handler(msg: Msg) -> None:
        deliveries.append(msg.metadata.num_delivered)
        if len(deliveries) < 3:
            raise Interrupted()

    stop = asyncio.Event()
    task, _, _ = await _run_consumer(js, stop, tenant, handler, ack_wait_s=30.0)
    await js.publish(subjects.train("tiny", tenant), b"x")
    # Redelivered at once (nak without delay), not after the 30 s ack wait.
    await eventually(lambda: len(deliveries) == 3, timeout=5, what="three deliveries")
    stop.set()
    await task
    assert deliveries == [1, 2, 3] and await dead_letters(js, "TRAIN", tenant) == []


async def test_stop_hands_back_the_messages_of_handlers_that_do_not_finish(
    js: JetStreamContext,
) -> None:
    tenant = uid("drain")
    started = asyncio.Event()

    async def stuck(msg: Msg) -> None:
        started.set()
        await asyncio.sleep(3600)  # ignores the stop event

    stop = asyncio.Event()
    task, _, durable = await _run_consumer(js, stop, tenant, stuck, concurrency=4, ack_wait_s=30)
    await js.publish(subjects.train("tiny", tenant), b"x")
    await asyncio.wait_for(started.wait(), 10)
    t0 = asyncio.get_running_loop().time()
    stop.set()
    await asyncio.wait_for(task, 5)
    assert asyncio.get_running_loop().time() - t0 < 4
    # Handed back (nak), not left to the 30 s ack wait: another consumer gets it at once.
    sub = await js.pull_subscribe_bind(durable, stream="TRAIN")
    msgs = await sub.fetch(1, timeout=3)
    assert msgs[0].data == b"x" and msgs[0].metadata.num_delivered == 2
    await msgs[0].ack()
    await sub.unsubscribe()


async def test_close_hands_back_what_a_pull_request_outliving_its_fetch_delivered(
    nc: NATS, js: JetStreamContext
) -> None:
    """A pull request the server still holds after the client's fetch timed out (its clock
    runs behind on a loaded machine) delivers into the subscription with no fetch waiting;
    close() must hand those back at once, not leave them to the ack wait."""
    tenant = uid("late")
    consumer = Consumer(js, asyncio.Event())
    spec = ConsumerSpec("TRAIN", uid("c"), subjects.train("tiny", tenant), ack_wait_s=30.0)
    durable = await consumer.bind(spec)
    assert await consumer.fetch(durable, 3, 0.05) == []
    # The orphan: a pull request for our inbox that no fetch waits on.
    orphan = b'{"batch": 3, "expires": 5000000000}'
    await nc.publish(
        f"$JS.API.CONSUMER.MSG.NEXT.TRAIN.{spec.durable}", orphan, durable.sub._deliver
    )
    for i in range(3):
        await js.publish(subjects.train("tiny", tenant), str(i).encode())

    async def delivered() -> bool:
        info = await js.consumer_info("TRAIN", spec.durable)
        return info.num_ack_pending == 3

    await eventually(delivered, timeout=5, what="the orphan's deliveries")
    consumer.stop.set()
    await consumer.close()
    probe = await js.pull_subscribe_bind(spec.durable, stream="TRAIN")
    msgs = await probe.fetch(3, timeout=2)
    assert sorted(m.data for m in msgs) == [b"0", b"1", b"2"]
    await asyncio.gather(*(m.ack() for m in msgs))
    await probe.unsubscribe()


async def test_a_message_no_stream_delivered_is_dropped_by_fetch_not_a_crash(
    nc: NATS, js: JetStreamContext
) -> None:
    """Someone publishes into a pull consumer's inbox (a service's answer that a tenant named
    it as the reply of): fetch returns the stream's messages only; reading the stray one's
    metadata used to raise and stop the consume loop."""
    tenant = uid("stray")
    consumer = Consumer(js, asyncio.Event())
    spec = ConsumerSpec("TRAIN", uid("c"), subjects.train("tiny", tenant), ack_wait_s=30.0)
    durable = await consumer.bind(spec)
    await nc.publish(durable.sub._deliver, b"not from the stream")
    await js.publish(subjects.train("tiny", tenant), b"real")
    got: list[Msg] = []
    for _ in range(20):  # the stray may come alone in a first fetch
        got += await consumer.fetch(durable, 2, 0.5)
        if got:
            break
    assert [m.data for m in got] == [b"real"]
    await asyncio.gather(*(consumer.settle(m, None) for m in got))
    await consumer.close()


async def test_a_durable_with_several_filters_gets_only_those_and_an_old_one_is_narrowed(
    js: JetStreamContext,
) -> None:
    """The master's event durable fetches only the kinds it acts on; one declared by an older
    layout with a broader filter is narrowed in place when bound (its position kept)."""
    tenant, job = uid("ev"), uid("job")
    durable = uid("evc")
    old = ConsumerSpec(subjects.STREAM_EVENTS, durable, subjects.events_of_job(tenant, job))
    await js.add_consumer(old.stream, old.config())
    await js.publish(subjects.event(tenant, job, "policy"), b"before")
    narrow = ConsumerSpec(
        subjects.STREAM_EVENTS,
        durable,
        tuple(subjects.event(tenant, job, kind) for kind in ("policy", "error")),
    )
    consumer = Consumer(js, asyncio.Event())
    bound = await consumer.bind(narrow)
    info = await js.consumer_info(subjects.STREAM_EVENTS, durable)
    assert set(info.config.filter_subjects or ()) == set(narrow.filters)
    for kind in ("progress", "policy", "progress", "error", "state"):
        await js.publish(subjects.event(tenant, job, kind), kind.encode())
    got = await consumer.fetch(bound, 10, 2.0)
    assert [m.data for m in got] == [b"before", b"policy", b"error"]
    await asyncio.gather(*(m.ack() for m in got))
    assert await consumer.fetch(bound, 10, 0.2) == []
    await js.delete_consumer(subjects.STREAM_EVENTS, durable)


async def test_a_durable_bound_with_other_delivery_settings_is_updated_to_them(
    js: JetStreamContext,
) -> None:
    """Found by an audit: a role restarted with another --ack-wait-s kept the consumer's old
    one (its in-progress acks, paced by the new one, then came too late: running tasks were
    delivered to a second worker), and another --max-deliver did nothing."""
    tenant, job = uid("ev"), uid("job")
    durable = uid("evc")
    filter_subject = subjects.events_of_job(tenant, job)
    first = ConsumerSpec(subjects.STREAM_EVENTS, durable, filter_subject, ack_wait_s=2.0)
    consumer = Consumer(js, asyncio.Event())
    await consumer.bind(first)
    await js.publish(subjects.event(tenant, job, "policy"), b"kept")
    changed = ConsumerSpec(
        subjects.STREAM_EVENTS,
        durable,
        filter_subject,
        ack_wait_s=9.0,
        max_deliver=2,
        max_ack_pending=7,
    )
    again = Consumer(js, asyncio.Event())
    bound = await again.bind(changed)
    info = await js.consumer_info(subjects.STREAM_EVENTS, durable)
    assert info.config.ack_wait == 9.0
    assert info.config.max_deliver == 2 + HAND_BACK_ALLOWANCE
    assert info.config.max_ack_pending == 7
    got = await again.fetch(bound, 10, 2.0)
    assert [m.data for m in got] == [b"kept"]  # its position is kept
    await asyncio.gather(*(m.ack() for m in got))
    await js.delete_consumer(subjects.STREAM_EVENTS, durable)


async def test_kv_follower_stops_on_the_event_and_leaves_no_subscription(
    nc: NATS, js: JetStreamContext
) -> None:
    kv = await js.key_value(subjects.KV_HEARTBEATS)
    key = uid("k")
    seen: list[str] = []
    before = len(nc._subs)
    for delay in (0.0, 0.001, 0.01, 0.05, 0.3):  # stop during set-up and while following
        stop = asyncio.Event()
        ready = asyncio.Event()
        follower = asyncio.create_task(
            follow_kv(kv, stop, lambda e: seen.append(e.key), on_ready=ready.set)
        )
        await kv.put(key, b"v")
        await asyncio.sleep(delay)
        stop.set()
        await asyncio.wait_for(follower, 2)  # returns on the event: never cancelled
    await kv.delete(key)
    assert await eventually(lambda: len(nc._subs) == before, what="watchers unsubscribed")
    assert key in seen


async def test_a_kv_follower_sees_entries_put_after_a_broker_restart(tmp_path: Path) -> None:
    """A watch that lived through a SIGKILL of the server and its restart on the same store
    is started again (its consumer is gone), so an entry put afterwards is still seen; the
    inferencer's policy versions come this way."""
    server = EmbeddedServer(tmp_path / "nats").start()
    nc = await connect(server.url)
    stop = asyncio.Event()
    try:
        js = nc.jetstream()
        await declare(js, BusLayout())
        kv = await js.key_value(subjects.KV_POLICIES)
        seen: list[bytes] = []
        ready = asyncio.Event()
        follower = asyncio.create_task(
            follow_kv(kv, stop, lambda e: seen.append(bytes(e.value or b"")), on_ready=ready.set)
        )
        await kv.put("acme.job", b"v1")
        await asyncio.wait_for(ready.wait(), 10)
        await eventually(lambda: b"v1" in seen or None, timeout=10, what="v1 seen")
        server.kill()
        server.restart()

        async def put_v2() -> bool | None:
            try:
                await kv.put("acme.job", b"v2")
            except (NatsError, TimeoutError):
                return None  # reconnecting
            return True

        await eventually(put_v2, timeout=20, what="v2 put after the restart")
        # Within seconds: left to itself, nats.py's watch notices only after its heartbeats
        # have been missed for a while (measured here: about 20 s).
        await eventually(lambda: b"v2" in seen or None, timeout=5, what="v2 seen")
        stop.set()
        await asyncio.wait_for(follower, 5)
    finally:
        stop.set()
        await nc.close()
        server.kill()


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


async def test_a_durable_that_fails_to_bind_is_bound_at_the_next_discovery(
    fresh_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker timeout while binding a new tenant's consumer went up through the trainer's
    loop and ended the process (every tenant's uncommitted work replayed). (A server of its
    own: the consumer it leaves on TRAIN would stop other tests' trainers binding theirs.)"""
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    tenant = uid("bind")
    await js.publish(subjects.train("tiny", tenant), b"x")
    stop = asyncio.Event()
    consumer = Consumer(js, stop)
    durable = uid("d")
    found = DurableSet(
        consumer,
        subjects.STREAM_TRAIN,
        subjects.train("tiny", tenant),
        lambda key: ConsumerSpec(subjects.STREAM_TRAIN, durable, subjects.train("tiny", key)),
        lambda subject: tenant if subject == subjects.train("tiny", tenant) else None,
    )
    real_bind = consumer.bind
    failures: list[str] = []

    async def bind_times_out_once(spec: ConsumerSpec, on_dead: Any = None) -> Any:
        failures.append(spec.durable)
        if len(failures) == 1:
            raise NatsTimeoutError
        if len(failures) == 2:  # what bind says when another consumer holds the subject
            raise RuntimeError("cannot create consumer (filtered consumer not unique)")
        return await real_bind(spec, on_dead)

    monkeypatch.setattr(consumer, "bind", bind_times_out_once)
    assert await found.discover() == []
    assert await found.discover() == []  # that key is not served; discovery goes on
    assert await found.discover() == [tenant]
    assert failures == [durable] * 3
    await consumer.close()
    await nc.close()


async def test_a_message_handed_back_keeps_its_crash_count_and_a_hung_one_its_start(
    js: JetStreamContext,
) -> None:
    """A message counted in the crash ledger and handed back (a stop) has the start this
    process counted taken back, the crashes before it kept; one handed back while its handling
    still runs (a stop that could not wait for a hang) keeps that start too: a hang that ends
    in a restart counts like a crash."""
    tenant = uid("handback")
    consumer = Consumer(js, asyncio.Event())
    durable = await consumer.bind(
        ConsumerSpec("TRAIN", uid("c"), subjects.train("tiny", tenant), max_deliver=10)
    )
    await js.publish(subjects.train("tiny", tenant), b"x")
    kv = await js.key_value(subjects.KV_CRASHES)

    async def delivery(n: int) -> Msg:
        msgs = await eventually(
            lambda: consumer.fetch(durable, 1, 0.5) or None, what=f"delivery {n}"
        )
        assert msgs[0].metadata.num_delivered == n
        return msgs[0]

    first = await delivery(1)  # a first delivery is not counted
    key = f"TRAIN.{durable.name}.{first.metadata.sequence.stream}"
    await kv.put(key, b"2")  # two crashes before, counted by a process that died
    await consumer.hand_back([first])
    await consumer.hand_back([await delivery(2)])  # counted 3 at fetch, then taken back
    assert (await kv.get(key)).value == b"2"
    await consumer.hand_back([await delivery(3)], still_running=True)
    assert (await kv.get(key)).value == b"3"
    await consumer.settle(await delivery(4), None)
    await eventually(lambda: _drained(js, durable.name), what="nothing pending or unacked")
    await consumer.close()


async def test_a_message_handed_back_on_its_last_delivery_is_dead_lettered_not_lost(
    js: JetStreamContext,
) -> None:
    """The server delivers a message at most ``max_deliver`` + HAND_BACK_ALLOWANCE times; a
    message handed back (a stop, a deferral) on that last delivery would never come again.
    It is dead-lettered instead."""
    tenant = uid("lastnak")
    consumer = Consumer(js, asyncio.Event())
    durable = await consumer.bind(
        ConsumerSpec("TRAIN", uid("c"), subjects.train("tiny", tenant), max_deliver=1)
    )
    await js.publish(subjects.train("tiny", tenant), b"x")
    server_max = 1 + HAND_BACK_ALLOWANCE
    for delivery in range(1, server_max + 1):
        msgs = await eventually(
            lambda: consumer.fetch(durable, 1, 0.5, count_crashes=False) or None,
            what=f"delivery {delivery}",
        )
        assert msgs[0].metadata.num_delivered == delivery
        assert consumer.can_hand_back(msgs[0]) == (delivery < server_max)
        await consumer.hand_back(msgs)
    dead = await eventually(lambda: dead_letters(js, "TRAIN", tenant), what="dead letter")
    assert dead[0].num_delivered == server_max and "last delivery" in dead[0].reason
    await eventually(lambda: _drained(js, durable.name), what="nothing pending or unacked")
