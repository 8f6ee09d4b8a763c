"""A :class:`~vla.feature.VLAFeature` to and from its wire record
(:class:`schemas.feature.FeatureRecord`), checked on the way in.

A record from the wire is checked before a head sees it: dtype and dims of every tensor,
their agreement (B samples, T tokens), the sample ids, the producer (a consumer passes the
backbone, layer and key it expects, and a record of any other is refused: features of
another backbone, layer or preprocessing are never mixed in), and finiteness of the prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from schemas.feature import FEATURE_DTYPES, EncodeRequest, FeatureRecord
from schemas.tensor import Tensor, TensorError, check_finite
from vla.feature import PIXELS_U8, CompatKey, ModelInputs, VLAFeature

#: The backbone inputs every request carries (the architecture's own ones may follow)...
REQUIRED_INPUTS = ("input_ids", "attention_mask")
#: ... and its views, as exactly one of: normalised values, or resized uint8 (a quarter of the
#: bytes; what head-only trainers and inferencers send).
PIXEL_INPUTS = ("pixel_values", PIXELS_U8)


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


def to_encode_request(
    inputs: ModelInputs, feature_layer: int, sample_ids: Sequence[str]
) -> EncodeRequest:
    """Ask for ``inputs``' features (their backbone tensors; proprio stays with the caller)."""
    if len(sample_ids) != inputs.batch_size:
        raise FeatureRecordError(
            f"sample_ids: {len(sample_ids)} for a batch of {inputs.batch_size}"
        )
    key = inputs.key
    return EncodeRequest(
        backbone_id=key.backbone_id,
        feature_layer=feature_layer,
        image_size=key.image_size,
        num_views=key.num_views,
        token_budget=key.token_budget,
        sample_ids=list(sample_ids),
        tensors={name: Tensor.from_torch(t) for name, t in inputs.tensors.items()},
    )


def from_encode_request(request: EncodeRequest, expect_layer: int) -> tuple[ModelInputs, int]:
    """The request's :class:`ModelInputs` (an empty proprio) and feature layer, checked: it
    must ask for ``expect_layer`` (the serving backbone's), carry the required inputs with
    one batch size that matches its sample ids. Raises :class:`FeatureRecordError` naming the
    field; the backbone itself checks the key (:meth:`vla.backbone.Backbone.model_kwargs`)."""
    if request.feature_layer != expect_layer:
        raise FeatureRecordError(
            f"feature_layer: {request.feature_layer} asked of a backbone serving layer "
            f"{expect_layer}"
        )
    missing = [n for n in REQUIRED_INPUTS if n not in request.tensors]
    if missing:
        raise FeatureRecordError(f"tensors: missing {missing}")
    pixels = [n for n in PIXEL_INPUTS if n in request.tensors]
    if len(pixels) != 1:
        raise FeatureRecordError(
            f"tensors: expected exactly one of {list(PIXEL_INPUTS)}, got {pixels or 'none'}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in request.tensors.items():
        try:
            tensor.validate()
        except TensorError as exc:
            raise FeatureRecordError(f"tensors[{name!r}]: {exc}") from exc
        if not tensor.shape or tensor.shape[0] != len(request.sample_ids):
            raise FeatureRecordError(
                f"tensors[{name!r}]: shape {tensor.shape} for {len(request.sample_ids)} samples"
            )
        tensors[name] = tensor.to_torch()
    key = CompatKey(
        request.backbone_id, request.image_size, request.num_views, request.token_budget
    )
    empty_proprio_B_0 = torch.zeros(len(request.sample_ids), 0)
    return ModelInputs(key, tensors, empty_proprio_B_0), request.feature_layer


class WireEncoder:
    """A feature encoder whose forward runs elsewhere: ``send`` takes an
    :class:`~schemas.feature.EncodeRequest` and returns the backbone's record (e.g.
    :meth:`bus.encoding.FeatureClient.request_sync`; its errors propagate). The record is
    checked against the backbone, layer and preprocessing asked for; proprio, which the
    backbone never reads, is attached here."""

    def __init__(
        self,
        send: Callable[[EncodeRequest], FeatureRecord],
        feature_layer: int,
        device: str = "cpu",
    ) -> None:
        self.send = send
        self.feature_layer = feature_layer
        self.device = device
        self._numbers = itertools.count(1)

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        number = next(self._numbers)
        ids = [f"{number}:{i}" for i in range(inputs.batch_size)]
        record = self.send(to_encode_request(inputs, self.feature_layer, ids))
        feature = from_record(record, FeatureOrigin(inputs.key, self.feature_layer), self.device)
        if record.sample_ids != ids:
            raise FeatureRecordError("sample_ids: the answer covers other samples than asked for")
        return VLAFeature(
            feature.prefix_B_T_D, feature.mask_B_T, inputs.proprio_B_P.to(self.device)
        )
