"""The feature cache's second tier: an object-store bucket per backbone (the trainer's).

Behind a trainer's in-memory :class:`vla.featurecache.FeatureCache`, features that memory
cannot hold, or that another trainer of the backbone (or this one before a restart)
computed, are kept in the bucket ``featcache-<backbone>`` (:func:`schemas.subjects.
feature_cache_bucket`), one object per sample: a one-row :class:`~schemas.feature.
FeatureRecord` named by the digest of its whole key (backbone id, feature layer,
compatibility key, sample digest). A record read back is checked against the key it was
asked for (:func:`vla.wire.check_record`), so an entry is never used across backbones,
layers or preprocessing.

The operator sets the bucket's budget; past it the least recently used objects are deleted.
Recency is what this process saw (its own gets and puts, and the objects' modification
times when it listed the bucket): with several trainers on one bucket, eviction follows
each one's view. The tier is called from the trainer's compute thread (the encoder runs
there), so its calls hand their work to the event loop and wait for it
(:meth:`BucketFeatureStore.get_many`), and writes go on in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig
from nats.js.errors import (
    BadObjectMetaError,
    BucketNotFoundError,
    DigestMismatchError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.object_store import ObjectStore

from bus.codec import DecodeError, decode, encode
from bus.kv import ChunksMissingError, list_objects, read_object_into
from schemas import subjects
from schemas.feature import FEATURE_RECORD_DECODER
from vla.feature import VLAFeature
from vla.featurecache import CacheKey
from vla.wire import FeatureOrigin, FeatureRecordError, from_record, to_record

log = logging.getLogger(__name__)

#: How long a listing of the bucket (what other trainers stored) is trusted.
RELIST_S = 30.0


def object_name(key: CacheKey, weights: str = "") -> str:
    """The object a key's features are stored as: the digest of the whole key and of the
    backbone's ``weights`` (:meth:`vla.backbone.Backbone.weights_digest`): a bucket outlives
    the processes, and a checkpoint rewritten in place keeps its id."""
    backbone_id, layer, compat, digest = key
    parts = (backbone_id, layer, compat.backbone_id, compat.image_size, compat.num_views)
    text = "|".join(str(p) for p in (*parts, compat.token_budget, digest, weights))
    return hashlib.sha256(text.encode()).hexdigest()


class BucketFeatureStore:
    """Per-sample features in the backbone's feature-cache bucket, under ``budget_bytes``."""

    def __init__(
        self,
        js: JetStreamContext,
        loop: asyncio.AbstractEventLoop,
        backbone_id: str,
        budget_bytes: int,
        timeout_s: float = 10.0,
        max_pending_bytes: int = 64 << 20,
        weights: str = "",
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.js = js
        self.loop = loop
        self.backbone_id = backbone_id
        #: The digest of the weights features are stored for (part of every object's name:
        #: another weights' features are misses, and age out of the budget).
        self.weights = weights
        self.budget_bytes = budget_bytes
        self.timeout_s = timeout_s
        self.bucket = subjects.feature_cache_bucket(backbone_id)
        self.store: ObjectStore | None = None
        #: Objects known to be stored (name → bytes), least recently used first.
        self.index: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0
        self.listed_at = 0.0
        self.hits = 0
        self.misses = 0
        self.puts = 0
        self.evictions = 0
        self._writes: set[asyncio.Future[None]] = set()
        self._lock = asyncio.Lock()
        #: Bytes of features waiting to be written, at most ``max_pending_bytes``: writes
        #: run one at a time, and a slow bucket must not grow the trainer's memory with its
        #: training rate (the store is a cache: what is not written is recomputed).
        self.pending_bytes = 0
        self.max_pending_bytes = max_pending_bytes
        self.dropped_writes = 0

    # -- from the compute thread ----------------------------------------------------------

    def get_many(self, keys: Sequence[CacheKey]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Each key's ``(prefix_T_D, mask_T)`` from the bucket, or None (not stored, or
        unreadable: a miss, never an error). Blocks the calling (worker) thread."""
        if threading.get_ident() == getattr(self.loop, "_thread_id", None):
            raise RuntimeError("BucketFeatureStore.get_many blocks: call it from a worker thread")
        future = asyncio.run_coroutine_threadsafe(self.fetch(keys), self.loop)
        try:
            return future.result(self.timeout_s)
        except (TimeoutError, NatsError) as exc:  # the tier is slow or away: recompute
            log.warning("feature store: %d gets gave up: %s", len(keys), exc)
            future.cancel()
            return [None] * len(keys)
        except Exception:  # a cache: whatever fails is a miss, not a failed step
            log.exception("feature store: %d gets failed; computed instead", len(keys))
            return [None] * len(keys)

    def put_many(self, items: Sequence[tuple[CacheKey, torch.Tensor, torch.Tensor]]) -> None:
        """Store these features in the background (a write that fails is only logged)."""
        if not items:
            return
        copies = [
            (k, p.detach().to("cpu").clone(), m.detach().to("cpu").clone()) for k, p, m in items
        ]
        self.loop.call_soon_threadsafe(self._start_write, copies)

    # -- on the event loop ----------------------------------------------------------------

    async def open(self) -> None:
        """Create or open the bucket and list what it holds."""
        try:
            self.store = await self.js.object_store(self.bucket)
        except (BucketNotFoundError, NotFoundError):
            config = ObjectStoreConfig(bucket=self.bucket, description="feature cache")
            self.store = await self.js.create_object_store(self.bucket, config=config)
        await self.relist()

    async def relist(self) -> None:
        """Learn the bucket's objects (other trainers' too), oldest first by their time."""
        assert self.store is not None
        known = sorted(
            (i for i in await list_objects(self.store) if i.name),
            key=lambda i: i.mtime or "",
        )
        fresh: OrderedDict[str, int] = OrderedDict((i.name, int(i.size or 0)) for i in known)
        for name in self.index:  # what this process used keeps its recency
            if name in fresh:
                fresh.move_to_end(name)
        self.index = fresh
        self.bytes = sum(fresh.values())
        self.listed_at = time.monotonic()

    async def fetch(
        self, keys: Sequence[CacheKey]
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        if time.monotonic() - self.listed_at > RELIST_S:
            await self.relist()
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for key in keys:
            found = await self._get(key)
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
            out.append(found)
        return out

    async def _get(self, key: CacheKey) -> tuple[torch.Tensor, torch.Tensor] | None:
        name = object_name(key, self.weights)
        if name not in self.index or self.store is None:
            return None
        buffer = io.BytesIO()
        try:
            await read_object_into(self.store, name, buffer)
            record = decode(FEATURE_RECORD_DECODER, buffer.getvalue())
            _, layer, compat, digest = key
            if record.sample_ids != [digest]:
                raise FeatureRecordError(f"object {name} holds other samples")
            feature = from_record(record, FeatureOrigin(compat, layer))
        except (ObjectNotFoundError, NotFoundError, ChunksMissingError):
            self._forget(name)  # evicted by another trainer
            return None
        except (
            DecodeError,
            FeatureRecordError,
            ValueError,
            TypeError,
            KeyError,
            DigestMismatchError,
            BadObjectMetaError,
        ) as exc:  # damaged data or metadata: unusable, never served
            log.warning("feature store: object %s is unusable (%s); dropping it", name, exc)
            self._forget(name)
            with contextlib.suppress(NatsError, NotFoundError, ObjectNotFoundError):
                await self.store.delete(name)
            return None
        self.index.move_to_end(name)
        return feature.prefix_B_T_D[0], feature.mask_B_T[0]

    def _start_write(self, items: list[tuple[CacheKey, torch.Tensor, torch.Tensor]]) -> None:
        size = sum(p.nbytes + m.nbytes for _, p, m in items)
        if self.pending_bytes + size > self.max_pending_bytes:
            self.dropped_writes += 1
            log.debug(
                "feature store: %d bytes waiting to be written; %d dropped",
                *(self.pending_bytes, size),
            )
            return
        self.pending_bytes += size
        task = asyncio.ensure_future(self.write(items))
        self._writes.add(task)
        task.add_done_callback(lambda t: self._written(t, size))

    def _written(self, task: asyncio.Future[None], size: int) -> None:
        self._writes.discard(task)
        self.pending_bytes -= size
        if not task.cancelled() and task.exception() is not None:
            log.warning("feature store: a write failed: %s", task.exception())

    async def write(self, items: Sequence[tuple[CacheKey, torch.Tensor, torch.Tensor]]) -> None:
        """Store the items not stored yet, then evict down to the budget."""
        assert self.store is not None
        async with self._lock:
            for key, prefix_T_D, mask_T in items:
                name = object_name(key, self.weights)
                if name in self.index:
                    self.index.move_to_end(name)
                    continue
                _, layer, compat, digest = key
                feature = VLAFeature(prefix_T_D[None], mask_T[None], torch.zeros(1, 0))
                record = to_record(feature, FeatureOrigin(compat, layer), [digest])
                data = encode(record)
                if len(data) > self.budget_bytes:
                    continue
                await self.store.put(name, data)
                self.index[name] = len(data)
                self.bytes += len(data)
                self.puts += 1
            await self._evict()

    async def _evict(self) -> None:
        assert self.store is not None
        while self.bytes > self.budget_bytes and self.index:
            name, _ = next(iter(self.index.items()))
            self._forget(name)
            self.evictions += 1
            with contextlib.suppress(ObjectNotFoundError, NotFoundError):
                await self.store.delete(name)

    def _forget(self, name: str) -> None:
        size = self.index.pop(name, None)
        if size is not None:
            self.bytes -= size

    async def clear(self) -> None:
        """Delete every object of the bucket (an operator's ``joynexus cache clear``)."""
        await self.drain()
        if self.store is None:
            return
        await self.relist()
        for name in list(self.index):
            with contextlib.suppress(ObjectNotFoundError, NotFoundError):
                await self.store.delete(name)
            self._forget(name)

    async def drain(self, within_s: float = 10.0) -> None:
        """Wait (bounded) for the background writes."""
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=within_s)

    def stats(self) -> dict[str, float]:
        looked = self.hits + self.misses
        return {
            "feature_store_entries": float(len(self.index)),
            "feature_store_bytes": float(self.bytes),
            "feature_store_hits": float(self.hits),
            "feature_store_misses": float(self.misses),
            "feature_store_hit_rate": self.hits / looked if looked else 0.0,
            "feature_store_evictions": float(self.evictions),
        }
