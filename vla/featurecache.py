"""A feature cache for a frozen backbone: each sample's features computed once.

The backbone is frozen, so a sample's features depend only on the sample (its normalised
inputs), the backbone, its feature layer and the normalisation (the compatibility key). A job
of E epochs would otherwise pay E backbone forwards per sample, and tenants training on the
same samples would each pay their own. :class:`CachedEncoder` stands in for the backbone
wherever a feature encoder is taken (:func:`vla.grouping.group_train_step`): the rows of a
batch found in the :class:`FeatureCache` are taken from it, and only the others go through
one backbone forward (and are added). The key is the sample's content digest together with
the backbone id, feature layer and compatibility key: an entry is never used across backbones,
layers or preprocessing. Behind the memory tier a :class:`FeatureStore` may keep what memory
does not (the trainer's object-store bucket, shared by its trainers and kept across
restarts: ``services.trainer.featurestore``).

Results are unchanged where the backbone is batch-invariant (a sample's features do not
depend on the other rows of its forward: the CPU kernels here are, as the grouped-vs-serial
tests show bit for bit), so a job's losses and parameters equal its run without the cache.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from vla.feature import CompatKey, ModelInputs, VLAFeature
from vla.grouping import FeatureEncoder

CacheKey = tuple[str, int, CompatKey, str]


def sample_digests(inputs: ModelInputs) -> list[str]:
    """Each row's content digest over every backbone input tensor (name, dtype, shape, bytes)."""
    names = sorted(inputs.tensors)
    rows = [inputs.tensors[n].detach().to("cpu").contiguous() for n in names]
    out = []
    for i in range(inputs.batch_size):
        h = hashlib.sha256()
        for name, t in zip(names, rows, strict=True):
            row = t[i]
            h.update(f"{name}:{row.dtype}:{tuple(row.shape)};".encode())
            h.update(
                row.numpy().tobytes()
                if row.dtype != torch.bfloat16
                else row.view(torch.int16).numpy().tobytes()
            )
        out.append(h.hexdigest())
    return out


@dataclass
class _Entry:
    prefix_T_D: torch.Tensor
    mask_T: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.prefix_T_D.nbytes + self.mask_T.nbytes


class FeatureCache:
    """Per-sample features under a byte budget, least recently used evicted first.

    Thread-safe: the trainer's compute thread reads and fills it while its event loop
    answers ``joynexus cache clear`` and stats (unlocked, a clear in the middle of a put's
    eviction raised in the step, and could leave the byte count above the entries)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0

    def get(self, key: CacheKey) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def peek(self, key: CacheKey) -> _Entry | None:
        """The entry, counting nothing (no hit, no miss, no recency)."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key: CacheKey, prefix_T_D: torch.Tensor, mask_T: torch.Tensor) -> None:
        entry = _Entry(prefix_T_D.detach().clone(), mask_T.detach().clone())
        with self._lock:
            if entry.nbytes > self.budget_bytes or key in self._entries:
                return
            self._entries[key] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.budget_bytes and self._entries:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.nbytes
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "feature_cache_entries": float(len(self._entries)),
                "feature_cache_bytes": float(self.bytes),
                "feature_cache_hits": float(self.hits),
                "feature_cache_misses": float(self.misses),
                "feature_cache_hit_rate": self.hit_rate,
                "feature_cache_evictions": float(self.evictions),
            }


class FeatureStore(Protocol):
    """A slower, larger tier behind the memory cache (e.g. an object-store bucket shared by
    every trainer of the backbone and kept across restarts). Called from the compute
    thread; a store that cannot answer answers None (the sample is encoded again)."""

    def get_many(self, keys: Sequence[CacheKey]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Each key's ``(prefix_T_D, mask_T)``, or None."""
        ...

    def put_many(self, items: Sequence[tuple[CacheKey, torch.Tensor, torch.Tensor]]) -> None:
        """Keep these (in the background: nothing waits for it)."""
        ...


class CachedEncoder:
    """``encode`` with the cache in front of ``backbone`` (one forward for the misses): the
    memory tier first, then ``store`` if given (what it has goes into memory), and what
    neither has is encoded and kept in both."""

    def __init__(
        self,
        backbone: FeatureEncoder,
        cache: FeatureCache,
        backbone_id: str,
        feature_layer: int,
        store: FeatureStore | None = None,
    ) -> None:
        self.backbone = backbone
        self.cache = cache
        self.backbone_id = backbone_id
        self.feature_layer = feature_layer
        self.store = store
        self.forwards = 0

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        keys: list[CacheKey] = [
            (self.backbone_id, self.feature_layer, inputs.key, d) for d in sample_digests(inputs)
        ]
        found = [self.cache.get(k) for k in keys]
        # A sample twice in one batch (two tenants on the same data, grouped) is encoded once.
        first: dict[CacheKey, int] = {}
        for i, entry in enumerate(found):
            if entry is None:
                first.setdefault(keys[i], i)
        if self.store is not None and first:
            stored = self.store.get_many(list(first))
            for key, hit in zip(list(first), stored, strict=True):
                if hit is not None:
                    self.cache.put(key, *hit)
                    entry = self.cache.peek(key)
                    for i in range(len(keys)):
                        if keys[i] == key:
                            found[i] = entry or _Entry(*hit)
                    del first[key]
        missing = list(first.values())
        computed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        device: torch.device | None = None
        if missing:
            rows = torch.tensor(missing)
            part = ModelInputs(
                inputs.key,
                {n: t[rows.to(t.device)] for n, t in inputs.tensors.items()},
                inputs.proprio_B_P[rows.to(inputs.proprio_B_P.device)],
            )
            feature = self.backbone.encode(part)
            self.forwards += 1
            device = feature.prefix_B_T_D.device
            for j, i in enumerate(missing):
                prefix, mask = feature.prefix_B_T_D[j], feature.mask_B_T[j]
                computed[i] = (prefix, mask)
                self.cache.put(keys[i], prefix, mask)
            if self.store is not None:
                self.store.put_many([(keys[i], *computed[i]) for i in missing])
        prefixes, masks = [], []
        for i, entry in enumerate(found):
            if entry is None:
                prefix, mask = computed[first[keys[i]]]
            else:
                prefix, mask = entry.prefix_T_D, entry.mask_T
            device = device or prefix.device
            prefixes.append(prefix.to(device))
            masks.append(mask.to(device))
        return VLAFeature(
            torch.stack(prefixes), torch.stack(masks), inputs.proprio_B_P.to(device or "cpu")
        )
