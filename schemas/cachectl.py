"""The trainers' feature caches, asked by an operator (core NATS, ``nexus.ctl.cache.<backbone>``,
:func:`schemas.subjects.cache_ctl`): every trainer of the backbone answers, so a requester
collects the answers for a moment (``joynexus cache stats|clear``). Services and the operator
only: a tenant's identity may not publish there."""

from __future__ import annotations

from typing import Literal

import msgspec


class CacheQuery(msgspec.Struct, frozen=True, tag="cache"):
    """``stats``: how the cache stands; ``clear``: drop every entry first (then its stats)."""

    op: Literal["stats", "clear"] = "stats"


class CacheStats(msgspec.Struct, frozen=True, tag="cache_stats"):
    """One trainer's feature cache (``enabled`` False: it runs without one)."""

    instance: str
    backbone_id: str
    enabled: bool
    budget_bytes: int = 0
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    evictions: int = 0
    cleared: bool = False
    #: The bucket tier (``--feature-store-mb``): objects in the backbone's feature-cache
    #: bucket as this trainer knows them, and its gets that found one or not.
    store_enabled: bool = False
    store_budget_bytes: int = 0
    store_entries: int = 0
    store_bytes: int = 0
    store_hits: int = 0
    store_misses: int = 0


CACHE_QUERY_DECODER = msgspec.msgpack.Decoder(CacheQuery)
CACHE_STATS_DECODER = msgspec.msgpack.Decoder(CacheStats)
