"""A put killed between its chunks and its metadata leaves chunks no object names; the sweep
(bus.sweep, run by the master) purges them once they have stayed unchanged long enough, and
nothing else."""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import sys

import pytest
from nats.js import JetStreamContext
from nats.js.object_store import ObjectStore

import bus.sweep
from bus.kv import ObjectListing, list_objects
from bus.server import EmbeddedServer
from bus.sweep import ChunkSweeper, object_buckets, sweep_every
from tests.conftest import Procs
from tests.helpers import eventually, uid

#: A process that puts an object whose source stalls after three chunks, so that it is
#: SIGKILLed with its chunks stored and its metadata never written.
STALLING_PUT = """
import asyncio, sys, time
import nats

class Stalls:
    chunks = 0
    def readinto(self, buffer):
        self.chunks += 1
        if self.chunks > 3:
            print("stalled", flush=True)
            time.sleep(600)
            return 0
        buffer[:] = bytes([self.chunks]) * len(buffer)
        return len(buffer)

async def main(url, bucket):
    nc = await nats.connect(url)
    store = await nc.jetstream().object_store(bucket)
    await store.put("doomed", Stalls())

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def stalling_put(url: str, bucket: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", STALLING_PUT, url, bucket],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


async def chunk_nuids(js: JetStreamContext, bucket: str) -> set[str]:
    prefix = f"$O.{bucket}.C."
    info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"{prefix}>")
    return {s[len(prefix) :] for s in (info.state.subjects or {})}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_the_chunks_of_a_killed_put_are_swept_and_live_objects_kept(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs
) -> None:
    bucket = uid("sweep")
    store = await js.create_object_store(bucket)
    kept = bytes(range(256)) * 1200  # 300 KiB: three chunks
    await store.put("kept", kept)
    replaced = await store.put("replaced", b"first")
    await store.put("replaced", b"second")  # the first version's chunks are purged
    gone = await store.put("gone", b"bye")
    await store.delete("gone")

    putter = procs.add(stalling_put(nats_server.url, bucket))
    assert putter.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(putter.stdout.readline), 30)
    assert line.strip() == b"stalled"
    putter.kill()
    putter.wait(10)
    putter.stdout.close()

    live = {o.nuid for o in await store.list() if not o.deleted}
    orphans = await chunk_nuids(js, bucket) - live
    assert len(orphans) == 1 and replaced.nuid not in orphans and gone.nuid not in orphans
    (orphan,) = orphans

    clock = FakeClock()
    sweeper = ChunkSweeper(js, min_age_s=60, clock=clock)
    assert await sweeper.sweep(bucket) == []  # noted, never purged on first sight
    # A chunk more (as if its put were still running): noted again from now.
    await js.publish(f"$O.{bucket}.C.{orphan}", b"more")
    clock.now = 100.0
    assert await sweeper.sweep(bucket) == []
    clock.now = 150.0
    assert await sweeper.sweep(bucket) == []  # 50 s unchanged: younger than the bound
    clock.now = 160.0
    assert await sweeper.sweep(bucket) == [orphan]
    assert await chunk_nuids(js, bucket) == live
    out = io.BytesIO()
    await store.get("kept", writeinto=out)
    assert out.getvalue() == kept
    assert bucket in await object_buckets(js)


async def test_a_listing_that_misses_an_object_purges_nothing(
    js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were the listing of the bucket's objects cut short, a live object would look like an
    orphan: the sweep compares it with the stream's metadata subjects and does nothing."""
    bucket = uid("partial")
    store = await js.create_object_store(bucket)
    for name in ("a", "b", "c"):
        await store.put(name, name.encode() * 1000)
    chunks = await chunk_nuids(js, bucket)
    full = bus.sweep.object_listing

    async def missing_one(store: ObjectStore, prefix: str = "") -> ObjectListing:
        listing = await full(store, prefix)
        return ObjectListing(listing.infos[1:], listing.subjects, listing.unreadable)

    clock = FakeClock()
    sweeper = ChunkSweeper(js, min_age_s=0, clock=clock)
    monkeypatch.setattr(bus.sweep, "object_listing", missing_one)
    for clock.now in (0.0, 10.0, 20.0):
        assert await sweeper.sweep(bucket) == []
    assert await chunk_nuids(js, bucket) == chunks
    monkeypatch.setattr(bus.sweep, "object_listing", full)
    for clock.now in (30.0, 40.0):
        assert await sweeper.sweep(bucket) == []  # nothing orphaned
    for name in ("a", "b", "c"):
        out = io.BytesIO()
        await store.get(name, writeinto=out)
        assert out.getvalue() == name.encode() * 1000


@pytest.mark.parametrize("damage", [b"not json", b"null", b"[]", b"7", b'{"name": 5}'])
async def test_a_damaged_metadata_entry_leaves_the_bucket_swept_and_listed(
    js: JetStreamContext, damage: bytes
) -> None:
    """Found by an audit: nats.py's listing stopped at an entry that is not an object's
    metadata and timed out, so the bucket (e.g. every tenant's checkpoints) was never swept
    again; readers of the bucket failed on it too. The entry is left out of listings; the
    orphan's chunks are purged; the live objects are kept."""
    bucket = uid("damaged")
    store = await js.create_object_store(bucket)
    for name in ("a", "b"):
        await store.put(name, name.encode() * 1000)
    await js.publish(f"$O.{bucket}.C.ORPHANNUID", b"y" * 50)  # a put cut short
    token = base64.urlsafe_b64encode(b"zz/damaged").decode()
    await js.publish(f"$O.{bucket}.M.{token}", damage)
    assert sorted(i.name for i in await list_objects(store)) == ["a", "b"]
    clock = FakeClock()
    sweeper = ChunkSweeper(js, min_age_s=0, clock=clock)
    for clock.now in (0.0, 10.0):
        await asyncio.wait_for(sweeper.sweep(bucket), 30)
    assert "ORPHANNUID" not in await chunk_nuids(js, bucket)
    for name in ("a", "b"):
        out = io.BytesIO()
        await store.get(name, writeinto=out)
        assert out.getvalue() == name.encode() * 1000


async def test_the_masters_sweep_loop_purges_over_two_passes_and_stops_on_its_event(
    js: JetStreamContext,
) -> None:
    bucket = uid("loop")
    store = await js.create_object_store(bucket)
    await store.put("live", b"x" * 1000)
    await js.publish(f"$O.{bucket}.C.orphannuid", b"left by a killed put")
    live = {o.nuid for o in await store.list()}
    stop = asyncio.Event()
    loop = asyncio.create_task(
        sweep_every(js, stop, every_s=0.05, first_after_s=0.0, min_age_s=0.0)
    )
    try:
        await eventually(lambda: _only(js, bucket, live), timeout=30, what="the orphan purged")
    finally:
        stop.set()
        await asyncio.wait_for(loop, 10)


async def _only(js: JetStreamContext, bucket: str, live: set[str | None]) -> bool:
    return await chunk_nuids(js, bucket) == live
