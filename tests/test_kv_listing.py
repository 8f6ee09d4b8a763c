"""bus.kv's consumer-free reads against a real nats-server: a key's history and an object
store's listing equal what nats.py's watcher-based calls return, and a read cancelled at any
moment (a service stopping) leaves no task, subscription or consumer behind."""

from __future__ import annotations

import asyncio
import io
import os
import random

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig
from nats.js.errors import DigestMismatchError, ObjectNotFoundError

from bus.checkpoints import CheckpointError, digest, get_checkpoint, read_object
from bus.kv import ChunksMissingError, kv_history, list_objects, read_object_into
from tests.helpers import uid


async def test_a_keys_history_equals_nats_pys_with_deletions_and_other_keys_between(
    js: JetStreamContext,
) -> None:
    kv = await js.create_key_value(KeyValueConfig(bucket=uid("hist"), history=10))
    assert await kv_history(kv, "a.job") == []
    await kv.put("a.job", b"one")
    await kv.put("other", b"x")
    await kv.put("a.job", b"two")
    await kv.delete("a.job")
    await kv.put("a.job", b"three")
    ours = await kv_history(kv, "a.job")
    theirs = await kv.history("a.job")
    assert [(e.key, e.value or b"", e.revision, e.operation) for e in ours] == [
        (e.key, e.value or b"", e.revision, e.operation) for e in theirs
    ]
    assert [e.value or b"" for e in ours] == [b"one", b"two", b"", b"three"]
    assert [e.operation for e in ours] == [None, None, "DEL", None]
    await kv.purge("a.job")
    assert [e.operation for e in await kv_history(kv, "a.job")] == ["PURGE"]


async def test_an_object_listing_equals_nats_pys_live_objects_under_the_prefix(
    js: JetStreamContext,
) -> None:
    store = await js.create_object_store(uid("objs"), config=ObjectStoreConfig())
    assert await list_objects(store) == []
    names = [f"t/job/v{v:06d}-abc" for v in range(1, 6)] + ["u/job/v000001-def", "t/other"]
    for i, name in enumerate(names):
        await store.put(name, bytes([i]) * (i + 1))
    await store.delete("t/job/v000002-abc")
    await store.put("t/job/v000003-abc", b"rewritten")
    theirs = {i.name: (i.size, i.digest, i.nuid) for i in await store.list() if not i.deleted}
    ours = {i.name: (i.size, i.digest, i.nuid) for i in await list_objects(store)}
    assert ours == theirs
    assert sorted(ours) == sorted(set(names) - {"t/job/v000002-abc"})
    under = sorted(i.name or "" for i in await list_objects(store, "t/job/v"))
    assert under == [
        "t/job/v000001-abc",
        "t/job/v000003-abc",
        "t/job/v000004-abc",
        "t/job/v000005-abc",
    ]
    assert ours["t/job/v000003-abc"][0] == len(b"rewritten")


async def test_an_object_reads_whole_and_one_missing_torn_or_grown_is_refused(
    js: JetStreamContext,
) -> None:
    bucket = uid("read")
    store = await js.create_object_store(bucket, config=ObjectStoreConfig())
    data = os.urandom(300_000)  # three chunks of nats.py's 128 KiB
    for name in ("whole", "torn", "grown", "gone"):
        await store.put(name, data)
    await store.put("empty", b"")
    out = io.BytesIO()
    info = await read_object_into(store, "whole", out)
    assert out.getvalue() == data and info.size == len(data)
    assert (await read_object_into(store, "empty", io.BytesIO())).size == 0
    chunks = f"$O.{bucket}.C."
    await js.purge_stream(f"OBJ_{bucket}", subject=chunks + (await store.get_info("torn")).nuid)
    with pytest.raises(ChunksMissingError, match="chunks end after 0 of 300000 bytes"):
        await read_object_into(store, "torn", io.BytesIO())
    await js.publish(chunks + (await store.get_info("grown")).nuid, b"one chunk too many")
    with pytest.raises(DigestMismatchError):
        await read_object_into(store, "grown", io.BytesIO())
    await store.delete("gone")
    for name in ("gone", "never-put"):
        with pytest.raises(ObjectNotFoundError):
            await read_object_into(store, name, io.BytesIO())


async def test_a_checkpoint_read_answers_gone_and_refuses_damaged_once_and_for_all(
    js: JetStreamContext,
) -> None:
    """bus.checkpoints.read_object: a damaged object is a CheckpointError its caller answers
    (a NatsError would be retried for ever), one deleted is None; get_checkpoint likewise."""
    bucket = uid("ckpt")
    store = await js.create_object_store(bucket, config=ObjectStoreConfig())
    data = os.urandom(300_000)
    for name in ("whole", "torn", "grown", "gone"):
        await store.put(name, data)
    chunks = f"$O.{bucket}.C."
    await js.purge_stream(f"OBJ_{bucket}", subject=chunks + (await store.get_info("torn")).nuid)
    await js.publish(chunks + (await store.get_info("grown")).nuid, b"one chunk too many")
    await store.delete("gone")
    assert await read_object(store, "whole") == data
    with pytest.raises(CheckpointError, match=r"torn is damaged: .*chunks end after 0 of"):
        await read_object(store, "torn")
    with pytest.raises(CheckpointError, match="grown is corrupt"):
        await read_object(store, "grown")
    assert await read_object(store, "gone") is None
    assert await read_object(store, "never-put") is None
    # A checkpoint read (the trainer's restore, the inferencer's load) says the same, where
    # a missing chunk was a NatsError: retried by the trainer every round for ever.
    assert await get_checkpoint(store, "whole", digest(data)) == data
    with pytest.raises(CheckpointError, match="does not match its recorded sha256"):
        await get_checkpoint(store, "whole", digest(b"other"))
    with pytest.raises(CheckpointError, match="torn is damaged"):
        await get_checkpoint(store, "torn", digest(data))
    with pytest.raises(CheckpointError, match="grown is corrupt"):
        await get_checkpoint(store, "grown", digest(data))
    with pytest.raises(CheckpointError, match="gone not found"):
        await get_checkpoint(store, "gone", digest(data))


async def test_reads_cancelled_at_random_moments_leave_nothing_behind(
    nc: NATS, js: JetStreamContext
) -> None:
    bucket = uid("cancel")
    store = await js.create_object_store(bucket, config=ObjectStoreConfig())
    for v in range(40):
        await store.put(f"t/job/v{v:06d}-abc", b"x" * 10)
    await store.put("big", os.urandom(2_000_000))
    kv = await js.create_key_value(KeyValueConfig(bucket=uid("cancelkv"), history=10))
    for v in range(10):
        await kv.put("t.job", str(v).encode())
    rng = random.Random(7)
    before = asyncio.all_tasks()
    subscriptions_before = len(nc._subs)
    reads = (
        lambda: list_objects(store),
        lambda: kv_history(kv, "t.job"),
        lambda: read_object_into(store, "big", io.BytesIO()),
    )
    for i in range(45):
        read = reads[i % 3]()
        task = asyncio.ensure_future(read)
        await asyncio.sleep(rng.uniform(0, 0.01))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() if t not in before and t is not current]
    assert not leaked
    assert len(nc._subs) == subscriptions_before
    for stream in (f"OBJ_{bucket}", kv._stream):
        assert (await js.stream_info(stream)).state.consumer_count == 0
    # and a read not cancelled still completes
    assert len(await list_objects(store)) == 41
    assert len(await kv_history(kv, "t.job")) == 10
