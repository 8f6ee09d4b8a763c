"""A :class:`~vla.feature.VLAFeature` to and from its wire record
(:class:`schemas.feature.FeatureRecord`), checked on the way in.

A record from the wire is checked before a head sees it: dtype and dims of every tensor,
their agreement (B samples, T tokens), the sample ids, the producer (a consumer passes the
backbone, layer and key it expects, and a record of any other is refused: features of
another backbone, layer or preprocessing are never mixed in), and finiteness of the prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from schemas.feature import FEATURE_DTYPES, FeatureRecord
from schemas.tensor import Tensor, TensorError, check_finite
from vla.feature import CompatKey, VLAFeature


class FeatureRecordError(ValueError):
    """A feature record that does not fit what it claims or what its consumer expects; the
    message names the field."""


@dataclass(frozen=True)
class FeatureOrigin:
    """What produced a feature: the compatibility key and the backbone's feature layer."""

    key: CompatKey
    feature_layer: int


def to_record(
    feature: VLAFeature, origin: FeatureOrigin, sample_ids: Sequence[str]
) -> FeatureRecord:
    """The feature as a wire record (tensors copied to CPU; bf16 bit-exact)."""
    prefix = feature.prefix_B_T_D
    if len(sample_ids) != feature.batch_size:
        raise FeatureRecordError(
            f"sample_ids: {len(sample_ids)} for a batch of {feature.batch_size}"
        )
    key = origin.key
    return FeatureRecord(
        backbone_id=key.backbone_id,
        feature_layer=origin.feature_layer,
        image_size=key.image_size,
        num_views=key.num_views,
        token_budget=key.token_budget,
        dtype=str(prefix.dtype).removeprefix("torch."),
        sample_ids=list(sample_ids),
        prefix=Tensor.from_torch(prefix),
        mask=Tensor.from_torch(feature.mask_B_T),
        proprio=Tensor.from_torch(feature.proprio_B_P.to(torch.float32)),
    )


def origin_of(record: FeatureRecord) -> FeatureOrigin:
    key = CompatKey(record.backbone_id, record.image_size, record.num_views, record.token_budget)
    return FeatureOrigin(key, record.feature_layer)


def check_record(record: FeatureRecord, expect: FeatureOrigin | None = None) -> None:
    """Raise :class:`FeatureRecordError` naming the first problem of ``record``."""
    if expect is not None and origin_of(record) != expect:
        raise FeatureRecordError(
            f"feature of {origin_of(record)}, expected {expect}: features of another "
            "backbone, layer or preprocessing cannot be used"
        )
    if record.dtype not in FEATURE_DTYPES or record.prefix.dtype != record.dtype:
        raise FeatureRecordError(
            f"prefix: dtype {record.prefix.dtype} (record says {record.dtype}); expected one "
            f"of {FEATURE_DTYPES}"
        )
    try:
        for name in ("prefix", "mask", "proprio"):
            getattr(record, name).validate()
        check_finite(record.prefix, "prefix")
    except TensorError as exc:
        raise FeatureRecordError(str(exc)) from exc
    if len(record.prefix.shape) != 3:
        raise FeatureRecordError(f"prefix: expected (B, T, D), got {record.prefix.shape}")
    b, t, _ = record.prefix.shape
    if record.mask.dtype not in ("bool", "uint8", "int64") or record.mask.shape != (b, t):
        raise FeatureRecordError(
            f"mask: expected bool/uint8 ({b}, {t}), got {record.mask.dtype} {record.mask.shape}"
        )
    if (
        record.proprio.dtype != "float32"
        or len(record.proprio.shape) != 2
        or record.proprio.shape[0] != b
    ):
        raise FeatureRecordError(
            f"proprio: expected float32 ({b}, P), got {record.proprio.dtype} {record.proprio.shape}"
        )
    if len(record.sample_ids) != b:
        raise FeatureRecordError(f"sample_ids: {len(record.sample_ids)} for a batch of {b}")


def from_record(
    record: FeatureRecord, expect: FeatureOrigin | None = None, device: str = "cpu"
) -> VLAFeature:
    """The checked record as a feature (one copy per tensor: torch needs writable memory)."""
    check_record(record, expect)
    return VLAFeature(
        record.prefix.to_torch().to(device),
        record.mask.to_torch().to(device),
        record.proprio.to_torch().to(device),
    )
