"""The inferencer's resident policies across jobs: at most ``max_resident_jobs`` jobs stay
in memory (the least recently served dropped first), and a restarted inferencer does not
load every job ever committed (the ``policies`` watch replays them all: records are kept)."""

from __future__ import annotations

import asyncio

import pytest

from bus.connect import connect
from bus.declare import declare
from bus.errors import PoisonError
from bus.server import EmbeddedServer
from services.inferencer.policies import PolicyCache
from tests.helpers import eventually, uid
from tests.test_inferencer import OFT, commit_policy
from vla.backbone import Backbone


async def test_resident_jobs_are_bounded_and_only_served_jobs_are_preloaded(
    fresh_server: EmbeddedServer,
) -> None:
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    hidden = Backbone.load("tiny").hidden_size
    tenant = uid("resident")
    jobs = ["a", "b", "c", "d"]
    for job in jobs:
        await commit_policy(js, tenant, job, OFT, hidden)
    stop = asyncio.Event()
    cache = PolicyCache(js, "cpu", 3, stop, max_resident_jobs=2)
    await cache.open()
    ready = asyncio.Event()
    follow = asyncio.create_task(cache.follow(ready))
    try:
        await asyncio.wait_for(ready.wait(), 20)
        # The watch replayed every job ever committed: none asked for, none remembered.
        assert cache.records == {}
        assert cache.resident_count == 0 and cache.loads == 0, "nothing loaded unasked"

        for job in ("a", "b", "c"):
            assert (await cache.resolve(tenant, job, 0)).version == 1
        assert cache.gauges()["resident_jobs"] == 2  # a, the least recently served, dropped
        assert (await cache.resolve(tenant, "b", 0)).version == 1  # b now the most recent
        loads = cache.loads
        assert loads == 3

        # A new version of a job being served is preloaded; one of a job nobody asks for
        # (d, or a dropped) is not.
        await commit_policy(js, tenant, "c", OFT, hidden, version=2)
        await commit_policy(js, tenant, "d", OFT, hidden, version=2)
        await eventually(lambda: cache.loads == loads + 1, timeout=20, what="c v2 preloaded")
        # A preload is not serving: c stays the least recently served, and goes first.
        assert list(cache._resident) == [(tenant, "c"), (tenant, "b")]
        assert (await cache.resolve(tenant, "a", 0)).version == 1  # loaded again, on demand
        assert list(cache._resident) == [(tenant, "b"), (tenant, "a")]
        assert cache.loads == loads + 2
        assert (await cache.resolve(tenant, "c", 0)).version == 2
        assert cache.loads == loads + 3
        assert cache.gauges()["resident_jobs"] == 2
        # Records are kept for the jobs served only (d's v2 came, nobody asked for it).
        assert set(cache.records) == set(cache._resident) == {(tenant, "a"), (tenant, "c")}
    finally:
        stop.set()
        await asyncio.wait_for(follow, 20)
        await cache.close(5)
        await nc.close()


async def test_latest_is_served_by_the_newest_version_when_the_one_known_was_pruned(
    fresh_server: EmbeddedServer,
) -> None:
    """A watch that lags (or a small --keep-versions) knows v1 as the latest after the
    trainer committed v2 and pruned v1: a request for the latest is served by v2, not
    refused for good because v1's checkpoint is gone."""
    from bus.records import get_policy
    from schemas import subjects

    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    hidden = Backbone.load("tiny").hidden_size
    tenant = uid("pruned")
    await commit_policy(js, tenant, "job", OFT, hidden)
    kv = await js.key_value(subjects.KV_POLICIES)
    first, _ = await get_policy(kv, tenant, "job")
    assert first is not None
    stop = asyncio.Event()
    cache = PolicyCache(js, "cpu", 3, stop)
    await cache.open()
    try:
        cache._note(first)  # what a lagging watch knows; no watch runs
        await commit_policy(js, tenant, "job", OFT, hidden, version=2)
        store = await js.object_store(subjects.OBJ_CHECKPOINTS)
        await store.delete(first.object_name)
        assert (await cache.resolve(tenant, "job", 0)).version == 2
        with pytest.raises(PoisonError, match="not found"):
            await cache.resolve(tenant, "job", 1)  # a pinned version is what it is
    finally:
        stop.set()
        await cache.close(5)
        await nc.close()


async def test_a_removed_jobs_resident_versions_are_no_longer_served(
    fresh_server: EmbeddedServer,
) -> None:
    """A job removed by its tenant (``job-rm`` purges its policy record and deletes its
    checkpoints) is dropped from memory: a version pinned before is not served from it."""
    from bus.kv import list_objects
    from schemas import subjects
    from schemas.jobs import job_key

    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    hidden = Backbone.load("tiny").hidden_size
    tenant = uid("removed")
    await commit_policy(js, tenant, "gone", OFT, hidden)
    stop = asyncio.Event()
    cache = PolicyCache(js, "cpu", 3, stop)
    await cache.open()
    ready = asyncio.Event()
    follow = asyncio.create_task(cache.follow(ready))
    try:
        await asyncio.wait_for(ready.wait(), 20)
        assert (await cache.resolve(tenant, "gone", 1)).version == 1
        assert (tenant, "gone") in cache._resident
        store = await js.object_store(subjects.OBJ_CHECKPOINTS)
        for info in await list_objects(store, f"{tenant}/gone/"):
            await store.delete(info.name)
        await (await js.key_value(subjects.KV_POLICIES)).purge(job_key(tenant, "gone"))
        await eventually(
            lambda: (tenant, "gone") not in cache._resident, timeout=20, what="dropped"
        )
        with pytest.raises(PoisonError):
            await cache.resolve(tenant, "gone", 1)
    finally:
        stop.set()
        await asyncio.wait_for(follow, 20)
        await cache.close(5)
        await nc.close()
