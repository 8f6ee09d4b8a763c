"""Where the trainer's backbone features come from, and the operator's view of its cache.

- :func:`feature_sources`: the resident backbone (its forwards split by a cost table where
  one is set), or the backbone role (``--backbone-service``: this process keeps the heads
  only); in front of either for SFT, the feature cache (``--feature-cache-mb``) and its
  bucket tier (``--feature-store-mb``). RL updates skip the cache: their observations are
  new every time.
- :func:`cache_stats`: the answer to ``joynexus cache stats|clear``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.errors import Error as NatsError

from bus.encoding import FeatureClient
from bus.service import Runtime
from schemas.cachectl import CacheQuery, CacheStats
from services.trainer.config import TrainerConfig
from services.trainer.featurestore import BucketFeatureStore
from vla import costmodel
from vla.backbone import Backbone
from vla.featurecache import CachedEncoder, FeatureCache
from vla.grouping import FeatureEncoder
from vla.wire import WireEncoder

log = logging.getLogger(__name__)


@dataclass
class FeatureSources:
    """What the trainer encodes with, and the parts it reports on and drains at stop."""

    #: SFT batches' encoder (the cache in front, when there is one).
    encoder: FeatureEncoder
    #: RL updates' encoder.
    rl_encoder: FeatureEncoder
    #: The backbone role's client, with ``--backbone-service``.
    remote: FeatureClient | None = None
    cache: FeatureCache | None = None
    store: BucketFeatureStore | None = None


async def feature_sources(rt: Runtime, config: TrainerConfig, backbone: Backbone) -> FeatureSources:
    """Build the encoders ``config`` asks for (the store's bucket is opened here)."""
    sources = FeatureSources(backbone, backbone)
    # Taken while the weights are here (a head-only trainer releases them below).
    weights = (
        await rt.slow(backbone.weights_digest)
        if config.feature_cache_mb > 0 and config.feature_store_mb > 0
        else ""
    )
    if config.backbone_service:  # the config refuses a cost table with it
        backbone.release_weights()
        sources.remote = FeatureClient(
            rt.nc,
            rt.js,
            asyncio.get_running_loop(),
            backbone.backbone_id,
            timeout_s=config.encode_timeout_s,
        )
        wire = WireEncoder(sources.remote.request_sync, backbone.feature_layer, config.device)
        sources.encoder = sources.rl_encoder = wire
    else:
        costs = await rt.slow(costmodel.table_for, backbone, config.cost_table)
        if costs is not None:
            sources.encoder = costmodel.SplitEncoder(backbone, costs)
    if config.feature_cache_mb > 0:
        sources.cache = FeatureCache(int(config.feature_cache_mb * 2**20))
        if config.feature_store_mb > 0:
            sources.store = BucketFeatureStore(
                rt.js,
                asyncio.get_running_loop(),
                backbone.backbone_id,
                int(config.feature_store_mb * 2**20),
                weights=weights,
            )
            await sources.store.open()
        sources.encoder = CachedEncoder(
            sources.encoder,
            sources.cache,
            backbone.backbone_id,
            backbone.feature_layer,
            sources.store,
        )
    return sources


async def cache_stats(
    instance: str,
    backbone_id: str,
    cache: FeatureCache | None,
    store: BucketFeatureStore | None,
    query: CacheQuery,
) -> CacheStats:
    """The cache's (and its bucket tier's) counts, after clearing both if ``query`` says so."""
    if cache is None:
        return CacheStats(instance, backbone_id, False)
    if query.op == "clear":
        cache.clear()
        if store is not None:
            try:
                await store.clear()
            except (NatsError, TimeoutError) as exc:
                log.warning("clearing the feature store failed: %s", exc)
            except Exception:  # a bug of ours: the operator's answer still goes out
                log.exception("clearing the feature store failed")
    return CacheStats(
        instance,
        backbone_id,
        True,
        cache.budget_bytes,
        len(cache),
        cache.bytes,
        cache.hits,
        cache.misses,
        cache.hit_rate,
        cache.evictions,
        cleared=query.op == "clear",
        store_enabled=store is not None,
        store_budget_bytes=store.budget_bytes if store else 0,
        store_entries=len(store.index) if store else 0,
        store_bytes=store.bytes if store else 0,
        store_hits=store.hits if store else 0,
        store_misses=store.misses if store else 0,
    )
