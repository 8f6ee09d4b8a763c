"""TRAIN messages over the server's max_payload travel by reference (bus.payloads): stored in
the payloads object store, fetched and checked by the trainer, deleted once acknowledged."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
import torch
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo
from nats.js.errors import NotFoundError

from bench import payloads as payloads_bench
from bench.payloads import episode
from bus.codec import decode, encode
from bus.consume import Consumer
from bus.declare import declare
from bus.durable import ConsumerSpec
from bus.errors import PoisonError, RetryableError
from bus.payloads import fetch_train, object_prefix, publish_train
from bus.records import get_policy
from bus.server import EmbeddedServer
from clients.sdk import Client
from schemas import subjects
from schemas.headers import MSG_ID
from schemas.train import TRAIN_DECODER, PayloadRef
from tests.conftest import Procs
from tests.helpers import dead_letters, eventually, uid
from tests.sft_helpers import (
    OFT_2D,
    final_policy,
    follow,
    record_datasets,
    registered,
    sft_spec,
    start_stack,
)
from tests.test_rl import rl_spec, start_rl_stack

LIMIT = 8 << 20


async def listed(js: JetStreamContext) -> list[ObjectInfo]:
    """Every object of the payloads bucket, deleted ones too (an empty bucket: none)."""
    store = await js.object_store(subjects.OBJ_PAYLOADS)
    try:
        return await store.list()
    except NotFoundError:
        return []


async def stored(js: JetStreamContext, job_id: str) -> list[str]:
    return sorted(
        o.name or "" for o in await listed(js) if not o.deleted and job_id in (o.name or "")
    )


async def last_message(js: JetStreamContext, subject: str) -> bytes:
    msg = await js.get_last_msg(subjects.STREAM_TRAIN, subject)
    return msg.data or b""


async def test_an_episode_over_max_payload_travels_by_reference_and_comes_back_the_same(
    js: JetStreamContext,
) -> None:
    await declare(js)
    tenant, job_id = uid("big"), uid("job")
    subject = subjects.train("tiny", tenant)
    max_payload = js._nc.max_payload

    small = episode(tenant, job_id, 10)  # ~120 KiB: inline
    await publish_train(js, subject, small, message_id=uid("m"), max_bytes=LIMIT)
    assert decode(TRAIN_DECODER, await last_message(js, subject)) == small

    big = episode(tenant, job_id, 120, 1)  # ~1.4 MiB: over the server's 1 MiB
    assert len(encode(big)) > max_payload
    message_id = uid("m")
    ack = await publish_train(js, subject, big, message_id=message_id, max_bytes=LIMIT)
    ref = decode(TRAIN_DECODER, await last_message(js, subject))
    assert isinstance(ref, PayloadRef)
    assert (ref.tenant, ref.job_id, ref.kind, ref.size) == (
        tenant,
        job_id,
        "rollout",
        len(encode(big)),
    )
    assert ref.object_name.startswith(object_prefix(tenant, job_id))
    assert decode(TRAIN_DECODER, await fetch_train(js, ref, LIMIT)) == big

    # A retried publish (same id) is the stream's duplicate: the object it stored is deleted,
    # the one the kept message names stays.
    again = await publish_train(js, subject, big, message_id=message_id, max_bytes=LIMIT)
    assert again.duplicate and again.seq == ack.seq
    assert await stored(js, job_id) == [ref.object_name]


async def test_a_message_over_max_message_bytes_is_refused_before_anything_is_stored(
    js: JetStreamContext,
) -> None:
    await declare(js)
    tenant, job_id = uid("huge"), uid("job")
    big = episode(tenant, job_id, 120)
    with pytest.raises(
        PoisonError, match=r"rollout of job .*: \d+ bytes exceeds max_message_bytes"
    ):
        await publish_train(
            js, subjects.train("tiny", tenant), big, message_id=uid("m"), max_bytes=1 << 20
        )
    assert await stored(js, job_id) == []


async def test_a_reference_that_cannot_be_honoured_is_a_specific_error(
    js: JetStreamContext,
) -> None:
    await declare(js)
    tenant, job_id = uid("forged"), uid("job")
    subject = subjects.train("tiny", tenant)
    await publish_train(
        js, subject, episode(tenant, job_id, 120), message_id=uid("m"), max_bytes=LIMIT
    )
    ref = decode(TRAIN_DECODER, await last_message(js, subject))
    assert isinstance(ref, PayloadRef)

    other_tenant = msgspec.structs.replace(ref, tenant=uid("other"))
    with pytest.raises(PoisonError, match="is not where tenant"):
        await fetch_train(js, other_tenant, LIMIT)
    with pytest.raises(PoisonError, match="exceeds max_message_bytes 1000"):
        await fetch_train(js, ref, 1000)
    wrong_size = msgspec.structs.replace(ref, size=ref.size + 1)
    with pytest.raises(PoisonError, match="do not match the reference"):
        await fetch_train(js, wrong_size, LIMIT)
    missing = msgspec.structs.replace(ref, object_name=object_prefix(tenant, job_id) + "gone")
    with pytest.raises(PoisonError, match="is gone"):
        await fetch_train(js, missing, LIMIT)


async def test_an_after_ack_hook_runs_only_once_its_message_is_acknowledged(
    js: JetStreamContext,
) -> None:
    """The hook that deletes a message's object runs after an ack only: a message that is
    retried or handed back still needs its object when it comes again."""
    tenant = uid("hook")
    consumer = Consumer(js, asyncio.Event())
    durable = await consumer.bind(
        ConsumerSpec("TRAIN", uid("c"), subjects.train("tiny", tenant), max_deliver=5)
    )
    await js.publish(subjects.train("tiny", tenant), b"x")
    ran: list[int] = []

    async def delivery(n: int) -> Msg:
        msgs = await eventually(
            lambda: consumer.fetch(durable, 1, 0.5, count_crashes=False) or None,
            what=f"delivery {n}",
        )
        assert msgs[0].metadata.num_delivered == n
        consumer.when_acked(msgs[0], lambda: _note(ran, n))
        return msgs[0]

    await consumer.settle(await delivery(1), RetryableError("not yet", delay_s=0.05))
    await consumer.hand_back([await delivery(2)])
    await consumer.settle(await delivery(3), None)
    assert ran == [3]
    await consumer.close()


async def _note(ran: list[int], n: int) -> None:
    ran.append(n)


@pytest.mark.stack
@pytest.mark.timeout(400)
async def test_sft_batches_and_episodes_over_max_payload_train_the_same_by_reference(
    nats_server: EmbeddedServer,
    procs: Procs,
    tmp_path: Path,
) -> None:
    """On a server whose max_payload (128 KiB) is under an SFT batch of 16 frames (~200 KB)
    and an RL episode of 20 steps (~250 KB), both jobs run, every by-reference object is deleted
    once consumed, and the SFT job's losses and parameters are those of the same job on a
    server of 1 MiB, where its batches travel inline."""
    small = EmbeddedServer(tmp_path / "small", max_payload=128 * 1024).start()
    try:
        start_rl_stack(small.url, tmp_path / "small-logs", procs)
        start_stack(nats_server.url, tmp_path / "logs", procs)
        datasets = record_datasets(tmp_path / "datasets")
        steps = 8
        async with (
            await Client.connect(small.url) as by_ref,
            await Client.connect(nats_server.url) as inline,
        ):
            specs = {}
            for client in (by_ref, inline):
                await declare(client.js)
                tenant = uid("arm")
                dataset = await registered(client.js, tenant, datasets["reach"])
                specs[client] = sft_spec(tenant, dataset, OFT_2D, steps, batch_size=16)
            rl_tenant = uid("rl")
            rl_job = await by_ref.train_rl(rl_spec(rl_tenant, 2, max_episode_steps=20))
            sft_jobs = {c: await c.train_sft(spec) for c, spec in specs.items()}
            traces = dict(
                zip(
                    sft_jobs,
                    await asyncio.gather(*(follow(j) for j in sft_jobs.values())),
                    strict=True,
                )
            )
            for job in (*sft_jobs.values(), rl_job):
                assert (await job.wait(120)).status == "succeeded"
            finals = {
                c: await final_policy(c.js, str(specs[c]["tenant"]), j.job_id)
                for c, j in sft_jobs.items()
            }

            # Every SFT batch and the longer episodes went by reference; none is left stored.
            objects = await listed(by_ref.js)

            def consumed(tenant: object) -> list[str]:
                return [
                    o.name or "" for o in objects if o.deleted and f"/{tenant}/" in (o.name or "")
                ]

            assert len(consumed(specs[by_ref]["tenant"])) >= steps
            assert consumed(rl_tenant)  # an episode that ends early may fit inline
            assert [o.name for o in objects if not o.deleted] == []
            # Under 1 MiB nothing of its was stored.
            inline_tenant = str(specs[inline]["tenant"])
            assert not [o for o in await listed(inline.js) if inline_tenant in (o.name or "")]
        losses = [traces[c].losses[s] for c in (by_ref, inline) for s in range(1, steps + 1)]
        assert losses[:steps] == losses[steps:]
        (_, params_ref), (_, params_inline) = finals[by_ref], finals[inline]
        for name, value in params_ref.items():
            assert torch.equal(value, params_inline[name]), name
    finally:
        small.stop()


@pytest.mark.stack
@pytest.mark.timeout(300)
async def test_a_redelivered_reference_whose_object_went_with_its_ack_is_recognised_as_applied(
    procs: Procs, tmp_path: Path
) -> None:
    """A message's object is deleted once the message is acknowledged; a copy delivered after
    that (an ack the server lost) finds no object. Its reference's step says it was applied:
    the trainer acknowledges it and the job goes on; a dead letter would fail the job."""
    small = EmbeddedServer(tmp_path / "small", max_payload=128 * 1024).start()
    try:
        start_stack(small.url, tmp_path / "logs", procs)
        datasets = record_datasets(tmp_path / "datasets")
        async with await Client.connect(small.url) as client:
            js = client.js
            await declare(js)
            tenant = uid("replay")
            dataset = await registered(js, tenant, datasets["reach"])
            published: list[Msg] = []

            async def keep(msg: Msg) -> None:
                published.append(msg)

            sub = await client.nc.subscribe(subjects.train("tiny", tenant), cb=keep)
            job = await client.train_sft(sft_spec(tenant, dataset, OFT_2D, 2000, batch_size=16))
            first = await eventually(
                lambda: next(
                    (m for m in published if isinstance(decode(TRAIN_DECODER, m.data), PayloadRef)),
                    None,
                ),
                timeout=60,
                what="a batch sent by reference",
            )
            await sub.unsubscribe()
            ref = decode(TRAIN_DECODER, first.data)
            assert isinstance(ref, PayloadRef) and ref.kind == "sft_batch"
            policies = await js.key_value(subjects.KV_POLICIES)

            async def committed_past() -> bool:
                record, _ = await get_policy(policies, tenant, job.job_id)
                return record is not None and record.batches_done > ref.step

            await eventually(committed_past, timeout=60, what=f"step {ref.step} committed")
            await eventually(
                lambda: _absent(js, ref.object_name), timeout=30, what="its object deleted"
            )

            replay = await js.publish(first.subject, first.data, headers={MSG_ID: uid("again")})
            await eventually(lambda: _settled(js, replay.seq), timeout=60, what="the copy consumed")
            record = await client.status(tenant, job.job_id)
            assert record is not None and record.status == "running"
            assert await dead_letters(js, "TRAIN", tenant) == []
            await job.cancel()
    finally:
        small.stop()


async def _absent(js: JetStreamContext, name: str) -> bool:
    return name not in await stored(js, name.split("/")[2])


async def _settled(js: JetStreamContext, seq: int) -> bool:
    try:
        await js.get_msg(subjects.STREAM_TRAIN, seq)
    except NotFoundError:
        return True
    return False


def test_the_payloads_bench_measures_inline_and_by_reference_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "payloads.json"
    argv = ["--episodes", "3", "--sizes", "10x1,100x2", "--json", str(out)]
    assert payloads_bench.main(argv) == 0
    small, large = json.loads(out.read_text())
    assert small["by_reference"] == 0.0 and small["mb"] < 0.2
    assert large["by_reference"] == 1.0 and large["mb"] > 2.0
    assert small["ratio"] > 0 and large["ratio"] > 0
