"""The feature cache's bucket tier (services/trainer/featurestore.py) on a real server: a
restarted trainer (empty memory) gets a stored sample's features from the bucket, bit for bit,
without a backbone forward; an entry is never served for another backbone, layer or
preprocessing; the bucket keeps to its budget, least recently used evicted first."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch
from nats.aio.client import Client as NATS

from schemas.cachectl import CacheQuery
from services.trainer.features import cache_stats
from services.trainer.featurestore import BucketFeatureStore, object_name
from tests.helpers import uid
from vla.backbone import Backbone
from vla.feature import ModelInputs, VLAFeature
from vla.featurecache import CachedEncoder, FeatureCache, sample_digests
from vla.normalize import Normaliser

SIZE = 4


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.load("tiny")


def samples(backbone: Backbone, seed: int, budget: int = 16) -> ModelInputs:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 255, (SIZE, 1, 32, 32, 3), dtype=np.uint8)
    proprio = rng.standard_normal((SIZE, 4)).astype(np.float32)
    return Normaliser(backbone, 1, budget).normalise_arrays(images, ["reach"] * SIZE, proprio)


class Counting:
    """The backbone, counting the rows it encodes."""

    def __init__(self, backbone: Backbone) -> None:
        self.backbone = backbone
        self.rows = 0

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        self.rows += inputs.batch_size
        return self.backbone.encode(inputs)


async def opened(nc: NATS, bid: str, budget: int, weights: str = "") -> BucketFeatureStore:
    loop = asyncio.get_running_loop()
    store = BucketFeatureStore(nc.jetstream(), loop, bid, budget, weights=weights)
    await store.open()
    return store


async def test_a_restarted_trainer_takes_stored_features_bit_for_bit(
    nc: NATS, backbone: Backbone
) -> None:
    bid, layer = uid("bb"), backbone.feature_layer
    inputs = samples(backbone, 0)
    first = await opened(nc, bid, 64 << 20)
    encoder = CachedEncoder(Counting(backbone), FeatureCache(64 << 20), bid, layer, first)
    computed = await asyncio.to_thread(encoder.encode, inputs)
    await first.drain()
    assert first.puts == SIZE and first.stats()["feature_store_entries"] == SIZE

    # Another process (a restart, another trainer of the backbone): nothing in memory.
    second = await opened(nc, bid, 64 << 20)
    counting = Counting(backbone)
    again = CachedEncoder(counting, FeatureCache(64 << 20), bid, layer, second)
    served = await asyncio.to_thread(again.encode, inputs)
    assert counting.rows == 0 and second.hits == SIZE
    assert torch.equal(served.prefix_B_T_D, computed.prefix_B_T_D)
    assert torch.equal(served.mask_B_T, computed.mask_B_T)
    assert again.cache.hits == 0 and len(again.cache) == SIZE  # now in memory too
    await asyncio.to_thread(again.encode, inputs)
    assert second.hits == SIZE and again.cache.hits == SIZE  # memory first

    # Never across layers or preprocessing: the same pixels are other samples there.
    for other in (
        CachedEncoder(counting, FeatureCache(64 << 20), bid, 0, second),
        CachedEncoder(counting, FeatureCache(64 << 20), bid, layer, second),
    ):
        data = inputs if other.feature_layer == 0 else samples(backbone, 0, budget=24)
        await asyncio.to_thread(other.encode, data)
    assert counting.rows == 2 * SIZE and second.hits == SIZE


async def test_features_of_other_weights_under_the_same_id_are_never_served(
    nc: NATS, backbone: Backbone
) -> None:
    """Found by an audit: the bucket outlives the processes, and its keys named the backbone
    id only, so a checkpoint rewritten in place (same id, new weights) trained on the old
    weights' features, silently. Objects are now named for the weights' digest too."""
    rewritten = Backbone.load("tiny")
    assert rewritten.weights_digest() == backbone.weights_digest()  # the same weights
    with torch.no_grad():
        next(rewritten.model.parameters()).add_(0.5)
    assert rewritten.weights_digest() != backbone.weights_digest()
    bid, layer, inputs = uid("bb"), backbone.feature_layer, samples(backbone, 5)
    old = await opened(nc, bid, 64 << 20, backbone.weights_digest())
    writer = CachedEncoder(backbone, FeatureCache(64 << 20), bid, layer, old)
    await asyncio.to_thread(writer.encode, inputs)
    await old.drain()
    new = await opened(nc, bid, 64 << 20, rewritten.weights_digest())
    counting = Counting(rewritten)
    reader = CachedEncoder(counting, FeatureCache(64 << 20), bid, layer, new)
    served = await asyncio.to_thread(reader.encode, inputs)
    assert counting.rows == SIZE and new.hits == 0  # computed with the new weights
    assert torch.equal(served.prefix_B_T_D, rewritten.encode(inputs).prefix_B_T_D)
    same = await opened(nc, bid, 64 << 20, backbone.weights_digest())
    again = CachedEncoder(Counting(backbone), FeatureCache(64 << 20), bid, layer, same)
    await asyncio.to_thread(again.encode, inputs)
    assert same.hits == SIZE  # the old weights' own features are still theirs


async def test_a_damaged_metadata_entry_is_a_miss_and_leaves_the_bucket_usable(
    nc: NATS, backbone: Backbone
) -> None:
    """Found by an audit: one object whose metadata was not an object's made every batch a
    full miss, then failed every training step after the next listing, `cache clear`, and a
    restarted trainer's start."""
    bid, layer, inputs = uid("bb"), backbone.feature_layer, samples(backbone, 6)
    store = await opened(nc, bid, 64 << 20)
    writer = CachedEncoder(backbone, FeatureCache(64 << 20), bid, layer, store)
    await asyncio.to_thread(writer.encode, inputs)
    await store.drain()
    keys = [(bid, layer, inputs.key, d) for d in sample_digests(inputs)]
    damaged = object_name(keys[0])
    token = base64.urlsafe_b64encode(damaged.encode()).decode()
    await nc.jetstream().publish(f"$O.{store.bucket}.M.{token}", b'{"name": 5}')
    reader = CachedEncoder(Counting(backbone), FeatureCache(64 << 20), bid, layer, store)
    await asyncio.to_thread(reader.encode, inputs)
    assert store.hits == SIZE - 1 and damaged not in store.index  # the others still serve
    store.listed_at = 0.0  # the next fetch lists the bucket again
    later = CachedEncoder(Counting(backbone), FeatureCache(64 << 20), bid, layer, store)
    await asyncio.to_thread(later.encode, inputs)
    restarted = await opened(nc, bid, 64 << 20)  # lists the bucket
    assert len(restarted.index) >= SIZE - 1
    stats = await cache_stats("i", bid, FeatureCache(1 << 20), store, CacheQuery(op="clear"))
    assert stats.enabled and store.stats()["feature_store_entries"] == 0


async def test_the_bucket_keeps_to_its_budget_least_recently_used_first(
    nc: NATS, backbone: Backbone
) -> None:
    bid, layer = uid("bb"), backbone.feature_layer
    probe = await opened(nc, bid, 64 << 20)
    encoder = CachedEncoder(backbone, FeatureCache(64 << 20), bid, layer, probe)
    await asyncio.to_thread(encoder.encode, samples(backbone, 1))
    await probe.drain()
    per_sample = probe.bytes // SIZE
    await probe.clear()
    assert probe.stats()["feature_store_entries"] == 0

    store = await opened(nc, bid, 6 * per_sample)  # room for six of the eight below
    old, new = samples(backbone, 2), samples(backbone, 3)
    writer = CachedEncoder(backbone, FeatureCache(64 << 20), bid, layer, store)
    await asyncio.to_thread(writer.encode, old)
    await store.drain()
    await asyncio.to_thread(writer.encode, new)
    await store.drain()
    assert store.bytes <= 6 * per_sample and store.evictions == 2
    listed = await store.store.list()  # type: ignore[union-attr]
    assert len([i for i in listed if not i.deleted]) == 6
    # A fresh reader finds the newer samples; of the older ones, only the two not evicted.
    reader = await opened(nc, bid, 6 * per_sample)
    counting = Counting(backbone)
    fresh = CachedEncoder(counting, FeatureCache(64 << 20), bid, layer, reader)
    await asyncio.to_thread(fresh.encode, new)
    assert counting.rows == 0
    await asyncio.to_thread(fresh.encode, old)
    assert counting.rows == 2


async def test_writes_waiting_for_a_slow_bucket_are_bounded(nc: NATS, backbone: Backbone) -> None:
    """Writes run one at a time; behind a slow bucket every grouped step with misses queued
    another copy of its features, and the trainer's memory grew with its training rate."""
    bid, layer = uid("bb"), backbone.feature_layer
    store = await opened(nc, bid, 64 << 20)
    encoder = CachedEncoder(backbone, FeatureCache(1 << 10), bid, layer, store)
    async with store._lock:  # the bucket "slow": no write gets through meanwhile
        await asyncio.to_thread(encoder.encode, samples(backbone, 1))
        await asyncio.sleep(0)  # (the write is scheduled onto this loop)
        one = store.pending_bytes
        assert one > 0
        store.max_pending_bytes = one  # room for that one write only
        for seed in (2, 3, 4):
            await asyncio.to_thread(encoder.encode, samples(backbone, seed))
        await asyncio.sleep(0)
        assert store.pending_bytes == one and store.dropped_writes == 3
    await store.drain()
    assert store.pending_bytes == 0 and store.stats()["feature_store_entries"] == SIZE
