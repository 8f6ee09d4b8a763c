"""The feature cache for a frozen backbone (:mod:`vla.featurecache`): two tenants training
on the same samples for several epochs get bit for bit the losses and parameters they get
without it, while the backbone runs once per distinct sample; entries never cross backbone
ids, feature layers or compatibility keys; the byte budget holds."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from bus.connect import connect
from bus.declare import declare
from bus.server import EmbeddedServer
from clients.lowlevel import ServiceClient, VLABatch
from schemas.model import HeadConfig, OptimizerConfig
from tests.conftest import Procs
from tests.helpers import service_env, start_service, uid
from tests.numerics import assert_same
from vla.backbone import Backbone
from vla.feature import CompatKey
from vla.featurecache import CachedEncoder, FeatureCache, sample_digests
from vla.grouping import FeatureEncoder, TrainRequest, group_train_step
from vla.normalize import Normaliser
from vla.slot import TenantSlot

HEADS = {
    "a": HeadConfig(kind="oft", action_dim=2, chunk_len=4, proprio_dim=4),
    "b": HeadConfig(kind="flow", action_dim=2, chunk_len=4, proprio_dim=4),
}
EPOCHS, BATCHES, SIZE = 3, 3, 4
HEAD_SPEC = {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.load("tiny")


def dataset() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.integers(0, 255, (SIZE, 1, 32, 32, 3), dtype=np.uint8),
            rng.standard_normal((SIZE, 4)).astype(np.float32),
            rng.uniform(-1, 1, (SIZE, 4, 2)).astype(np.float32),
        )
        for _ in range(BATCHES)
    ]


def train(
    backbone: Backbone, encoder: FeatureEncoder
) -> tuple[dict[str, list[float]], dict[str, TenantSlot]]:
    """Both tenants, every epoch over the same batches, grouped in one step per batch."""
    normaliser = Normaliser(backbone, 1, 16)
    slots = {
        t: TenantSlot(t, h, OptimizerConfig(), backbone.hidden_size, seed=i)
        for i, (t, h) in enumerate(HEADS.items())
    }
    losses: dict[str, list[float]] = {t: [] for t in HEADS}
    for _ in range(EPOCHS):
        for images, proprio, actions in dataset():
            inputs = normaliser.normalise_arrays(images, ["reach the red dot"] * SIZE, proprio)
            requests = [
                TrainRequest(t, slots[t], inputs, torch.from_numpy(actions.copy())) for t in HEADS
            ]
            for t, result in group_train_step(encoder, requests).items():
                assert not isinstance(result, Exception), result
                losses[t].append(result.loss)
    return losses, slots


def test_cached_training_is_bit_for_bit_the_uncached_one(backbone: Backbone) -> None:
    plain_losses, plain_slots = train(backbone, backbone)
    cache = FeatureCache(64 << 20)
    encoder = CachedEncoder(backbone, cache, backbone.backbone_id, backbone.feature_layer)
    cached_losses, cached_slots = train(backbone, encoder)
    assert cached_losses == plain_losses
    for t in HEADS:
        for p, q in zip(
            plain_slots[t].module.parameters(), cached_slots[t].module.parameters(), strict=True
        ):
            assert torch.equal(p, q)
    # Each distinct sample was encoded once: the first epoch's forwards only.
    assert encoder.forwards == BATCHES
    assert cache.misses == BATCHES * SIZE * len(HEADS)  # both tenants' rows in the group
    assert len(cache) == BATCHES * SIZE
    assert cache.hit_rate == pytest.approx(1 - 1 / EPOCHS)


def test_entries_never_cross_backbones_layers_or_keys(backbone: Backbone) -> None:
    normaliser = Normaliser(backbone, 1, 16)
    images, proprio, _ = dataset()[0]
    inputs = normaliser.normalise_arrays(images, ["reach"] * SIZE, proprio)
    cache = FeatureCache(64 << 20)
    CachedEncoder(backbone, cache, backbone.backbone_id, backbone.feature_layer).encode(inputs)
    assert cache.misses == SIZE
    for bid, layer in (("other", backbone.feature_layer), (backbone.backbone_id, 0)):
        CachedEncoder(backbone, cache, bid, layer).encode(inputs)
    assert cache.hits == 0 and len(cache) == 3 * SIZE
    # Another normalisation of the same pixels is another sample.
    longer = Normaliser(backbone, 1, 24).normalise_arrays(images, ["reach"] * SIZE, proprio)
    assert longer.key != inputs.key and isinstance(longer.key, CompatKey)
    assert set(sample_digests(longer)).isdisjoint(sample_digests(inputs))


def test_the_byte_budget_evicts_least_recently_used(backbone: Backbone) -> None:
    normaliser = Normaliser(backbone, 1, 16)
    images, proprio, _ = dataset()[0]
    inputs = normaliser.normalise_arrays(images, ["reach"] * SIZE, proprio)
    probe = FeatureCache(64 << 20)
    CachedEncoder(backbone, probe, backbone.backbone_id, 1).encode(inputs)
    per_sample = probe.bytes // SIZE
    cache = FeatureCache(2 * per_sample)
    encoder = CachedEncoder(backbone, cache, backbone.backbone_id, 1)
    feature = encoder.encode(inputs)
    assert len(cache) == 2 and cache.bytes <= 2 * per_sample and cache.evictions == SIZE - 2
    again = encoder.encode(inputs)  # the two kept rows hit; the rest are encoded again
    assert cache.hits == 2
    # The rows encoded again ran in a smaller forward: bitwise where the machine allows.
    assert_same(again.prefix_B_T_D, feature.prefix_B_T_D)


@pytest.mark.timeout(120)
async def test_a_trainers_cache_serves_repeats_and_the_operator_reads_and_clears_it(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """A trainer with ``--feature-cache-mb`` and its bucket tier: a session's repeated batch is
    a cache hit with the same loss, the first one's features went into the backbone's
    bucket; ``joynexus cache stats`` reports both tiers and ``cache clear`` empties them."""
    nc = await connect(fresh_server.url)
    await declare(nc.jetstream())
    await nc.close()
    procs.add(start_service("master", fresh_server.url, tmp_path / "master.log"))
    procs.add(
        start_service(
            "trainer",
            fresh_server.url,
            tmp_path / "trainer.log",
            "--feature-cache-mb",
            "16",
            "--feature-store-mb",
            "16",
        )
    )
    service = await ServiceClient.connect(fresh_server.url, tenant=uid("cache"))
    try:
        training = await service.create_training_client(head=HEAD_SPEC)
        rng = np.random.default_rng(0)
        batch = VLABatch(
            rng.integers(0, 255, (4, 1, 32, 32, 3), dtype=np.uint8),
            ["reach the red dot"] * 4,
            rng.standard_normal((4, 4)).astype(np.float32),
            rng.uniform(-1, 1, (4, 4, 2)).astype(np.float32),
        )
        first, again = await training.forward(batch), await training.forward(batch)
        assert first.loss == again.loss
        await training.close()
    finally:
        await service.close()

    def joynexus(*args: str) -> str:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "joynexus"), "cache", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=service_env(fresh_server.url),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    memory, bucket = joynexus("stats", "--url", fresh_server.url).splitlines()[-2:]
    stats = memory.split()
    assert stats[1:3] == ["on", "4"] and stats[-3:-1] == ["4", "4"], stats  # 4 hits, 4 misses
    assert bucket.split()[:4] == ["bucket", "tier", "on", "4"], bucket  # the 4 samples stored
    assert "(cleared)" in joynexus("clear", "--url", fresh_server.url)
    memory, bucket = joynexus("stats", "--url", fresh_server.url).splitlines()[-2:]
    assert memory.split()[2] == "0" and bucket.split()[3] == "0"


def test_clearing_while_the_compute_thread_fills_the_cache_never_breaks_a_put() -> None:
    """Found by an audit: ``joynexus cache clear`` (on the event loop) in the middle of a
    put's eviction (in the compute thread) raised in the training step, and could leave the
    byte count above what the entries hold, after which every put raised."""
    key = CompatKey("tiny", 32, 1, 16)
    prefix, mask = torch.zeros(16, 8), torch.ones(16, dtype=torch.bool)
    entry_bytes = prefix.nbytes + mask.nbytes
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: widens any window
    try:
        for trial in range(10):
            cache = FeatureCache(4 * entry_bytes)
            stop = threading.Event()
            errors: list[BaseException] = []

            def fill(
                cache: FeatureCache = cache,
                trial: int = trial,
                stop: threading.Event = stop,
                errors: list[BaseException] = errors,
            ) -> None:
                for i in range(1_000_000):
                    if stop.is_set():
                        return
                    try:
                        cache.put(("tiny", -1, key, f"{trial}-{i}"), prefix, mask)
                    except BaseException as exc:  # noqa: BLE001 - what the test looks for
                        errors.append(exc)
                        return

            filler = threading.Thread(target=fill)
            filler.start()
            for _ in range(5000):
                cache.clear()
            stop.set()
            filler.join(30)
            assert not errors, errors[0]
            held = sum(e.nbytes for e in cache._entries.values())
            assert cache.bytes == held <= cache.budget_bytes
    finally:
        sys.setswitchinterval(interval)
