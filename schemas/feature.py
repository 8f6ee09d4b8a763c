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


class EncodeRequest(msgspec.Struct, frozen=True, tag="encode"):
    """Asks the backbone role (:data:`schemas.subjects.features_encode`) for the features of
    ``B`` normalised samples; answered with a :class:`FeatureRecord` (or its
    :class:`FeatureRef`) in the same order, or an :class:`EncodeError`.

    The fields before ``tensors`` say what the requester expects to get back (a backbone
    that is another id, layer or preprocessing refuses it). ``tensors`` are the backbone's
    forward inputs, batch first (``input_ids``, ``attention_mask``, and the views as exactly
    one of float32 ``pixel_values`` (B, V, 3, S, S) or resized uint8 ``pixels_u8`` (B, V, S,
    S, 3), which the backbone normalises itself: a :class:`vla.feature.ModelInputs`' tensors).
    The tenant's proprio does not travel: the backbone does not read it."""

    backbone_id: str
    feature_layer: int
    image_size: int
    num_views: int
    token_budget: int
    sample_ids: list[str]
    tensors: dict[str, Tensor]


class BlobRef(msgspec.Struct, frozen=True, tag="blob_ref"):
    """A message too big for the bus, stored as object ``object_name`` of ``bucket`` (its
    msgpack encoding, ``size`` bytes with SHA-256 ``sha256``); the reader deletes it."""

    bucket: str
    object_name: str
    size: int
    sha256: str


class EncodeError(msgspec.Struct, frozen=True, tag="encode_error"):
    """An :class:`EncodeRequest` the backbone did not encode. ``retryable``: the same request
    may succeed later (the backbone was busy or stopping); else it never will (a bad tensor,
    another backbone), and ``message`` names the field."""

    message: str
    retryable: bool


FeatureMessage = FeatureRecord | FeatureRef
FEATURE_DECODER = msgspec.msgpack.Decoder(FeatureMessage)
FEATURE_RECORD_DECODER = msgspec.msgpack.Decoder(FeatureRecord)
#: What the backbone role receives: a request, inline or stored.
ENCODE_REQUEST_DECODER = msgspec.msgpack.Decoder(EncodeRequest | BlobRef)
#: The request itself, once fetched from its blob.
ENCODE_REQUEST_ONLY_DECODER = msgspec.msgpack.Decoder(EncodeRequest)
#: What the requester gets back.
ENCODE_REPLY_DECODER = msgspec.msgpack.Decoder(FeatureRecord | FeatureRef | BlobRef | EncodeError)
