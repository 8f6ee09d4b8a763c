""":class:`vla.feature.VLAFeature` on the wire: what a frozen backbone produced for a batch of
samples, so that it can cross a process boundary (a backbone served apart from the heads, a
feature cache shared by tenants) instead of living only inside a trainer.

A record names exactly what produced it (backbone id, feature layer and the compatibility
key's normalisation: image size, views, token budget), so a consumer never uses features
of another backbone, layer or preprocessing. Tensors travel as :class:`~schemas.tensor.Tensor`
(bf16 kept bit-exact as raw words). A record too big for one message is stored in the
backbone's feature bucket and travels as a :class:`FeatureRef` (:mod:`bus.features`).
Decode with :data:`FEATURE_DECODER`.
"""

from __future__ import annotations

import msgspec

from schemas.tensor import Tensor

#: Floating dtypes a feature's prefix may have.
FEATURE_DTYPES = ("float32", "bfloat16", "float16")


class FeatureRecord(msgspec.Struct, frozen=True, tag="feature"):
    """Backbone output for ``B`` samples.

    Shapes: ``prefix`` (B, T, D) in ``dtype``; ``mask`` uint8 or bool (B, T), 1 for real
    tokens; ``proprio`` float32 (B, P) (P may be 0). ``sample_ids`` has B entries (e.g. the
    content digests of the samples), in the batch's order."""

    backbone_id: str
    #: The backbone's resolved hidden-state index the prefix was taken from.
    feature_layer: int
    image_size: int
    num_views: int
    token_budget: int
    dtype: str
    sample_ids: list[str]
    prefix: Tensor
    mask: Tensor
    proprio: Tensor


class FeatureRef(msgspec.Struct, frozen=True, tag="feature_ref"):
    """A :class:`FeatureRecord` stored as object ``object_name`` of ``bucket`` (its msgpack
    encoding, ``size`` bytes with SHA-256 ``sha256``), for records over the message limit.
    It repeats what produced the record, so a consumer can refuse it without fetching it."""

    backbone_id: str
    feature_layer: int
    image_size: int
    num_views: int
    token_budget: int
    sample_ids: list[str]
    bucket: str
    object_name: str
    size: int
    sha256: str


FeatureMessage = FeatureRecord | FeatureRef
FEATURE_DECODER = msgspec.msgpack.Decoder(FeatureMessage)
FEATURE_RECORD_DECODER = msgspec.msgpack.Decoder(FeatureRecord)
