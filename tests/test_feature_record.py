"""The feature record (:mod:`schemas.feature`): a real backbone's output round-trips through
its wire record bit for bit (float32 and bf16), bad records are refused naming the field,
features of another backbone, layer or key are never taken, and a record over the server's
max payload travels by reference to the backbone's feature bucket (:mod:`bus.features`)."""

from __future__ import annotations

import dataclasses
import uuid

import msgspec
import numpy as np
import pytest
import torch
from nats.js import JetStreamContext

from bus.codec import decode, encode
from bus.features import FeatureTransportError, feature_store, pack, unpack
from schemas.feature import FEATURE_DECODER, FeatureRecord, FeatureRef
from schemas.tensor import Tensor
from vla.backbone import Backbone
from vla.feature import CompatKey, VLAFeature
from vla.normalize import Normaliser
from vla.wire import FeatureOrigin, FeatureRecordError, check_record, from_record, to_record


@pytest.fixture(scope="module")
def encoded() -> tuple[VLAFeature, FeatureOrigin]:
    backbone = Backbone.load("tiny")
    normaliser = Normaliser(backbone, 1, 16)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (3, 1, 32, 32, 3), dtype=np.uint8)
    proprio = rng.standard_normal((3, 4)).astype(np.float32)
    inputs = normaliser.normalise_arrays(images, ["reach the red dot"] * 3, proprio)
    return backbone.encode(inputs), FeatureOrigin(normaliser.key, backbone.feature_layer)


def ids(n: int) -> list[str]:
    return [f"sample-{i}" for i in range(n)]


def assert_same(a: VLAFeature, b: VLAFeature) -> None:
    for x, y in (
        (a.prefix_B_T_D, b.prefix_B_T_D),
        (a.mask_B_T, b.mask_B_T),
        (a.proprio_B_P, b.proprio_B_P),
    ):
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.dtype == torch.bfloat16:
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_backbones_feature_round_trips_bit_for_bit(
    encoded: tuple[VLAFeature, FeatureOrigin], dtype: torch.dtype
) -> None:
    feature, origin = encoded
    feature = dataclasses.replace(feature, prefix_B_T_D=feature.prefix_B_T_D.to(dtype))
    record = to_record(feature, origin, ids(3))
    wire = decode(FEATURE_DECODER, encode(record))
    assert isinstance(wire, FeatureRecord) and wire.dtype == str(dtype).removeprefix("torch.")
    assert_same(from_record(wire, expect=origin), feature)


def test_features_of_another_backbone_layer_or_key_are_refused(
    encoded: tuple[VLAFeature, FeatureOrigin],
) -> None:
    feature, origin = encoded
    record = to_record(feature, origin, ids(3))
    key = origin.key
    for other in (
        FeatureOrigin(dataclasses.replace(key, backbone_id="other"), origin.feature_layer),
        FeatureOrigin(key, origin.feature_layer - 1),
        FeatureOrigin(dataclasses.replace(key, token_budget=key.token_budget + 1), 1),
        FeatureOrigin(CompatKey(key.backbone_id, key.image_size * 2, 1, 16), origin.feature_layer),
    ):
        with pytest.raises(FeatureRecordError, match="cannot be used"):
            from_record(record, expect=other)


def test_malformed_records_are_refused_naming_the_field(
    encoded: tuple[VLAFeature, FeatureOrigin],
) -> None:
    feature, origin = encoded
    good = to_record(feature, origin, ids(3))
    nan_prefix = feature.prefix_B_T_D.clone()
    nan_prefix[0, 0, 0] = float("nan")
    bad = {
        "sample_ids": msgspec.structs.replace(good, sample_ids=ids(2)),
        "mask": msgspec.structs.replace(good, mask=Tensor.from_torch(feature.mask_B_T[:, :-1])),
        "proprio": msgspec.structs.replace(good, proprio=Tensor.from_numpy(np.zeros((2, 4), "f4"))),
        "prefix: dtype": msgspec.structs.replace(good, dtype="int64"),
        "NaN": msgspec.structs.replace(good, prefix=Tensor.from_torch(nan_prefix)),
        "needs": msgspec.structs.replace(
            good, prefix=Tensor("float32", good.prefix.shape, good.prefix.data[:-4])
        ),
    }
    check_record(good, origin)
    for what, record in bad.items():
        with pytest.raises(FeatureRecordError, match=what):
            check_record(record, origin)
    with pytest.raises(FeatureRecordError, match="sample_ids"):
        to_record(feature, origin, ids(4))


async def test_a_record_over_max_payload_travels_by_reference(
    js: JetStreamContext, encoded: tuple[VLAFeature, FeatureOrigin]
) -> None:
    _, origin = encoded
    backbone = f"bb-{uuid.uuid4().hex[:8]}"
    origin = FeatureOrigin(dataclasses.replace(origin.key, backbone_id=backbone), 2)
    max_payload = js._nc.max_payload
    small = to_record(
        VLAFeature(torch.randn(2, 8, 16), torch.ones(2, 8, dtype=torch.bool), torch.zeros(2, 0)),
        origin,
        ids(2),
    )
    data, ref = await pack(js, small, max_payload)
    assert ref is None and len(data) < max_payload
    assert await unpack(js, data) == small

    # float32 (4, 64, 1024) alone is 1 MiB: more than one message holds.
    big_feature = VLAFeature(
        torch.randn(4, 64, 1024), torch.ones(4, 64, dtype=torch.bool), torch.randn(4, 7)
    )
    big = to_record(big_feature, origin, ids(4))
    assert len(encode(big)) > max_payload
    data, ref = await pack(js, big, max_payload)
    assert isinstance(ref, FeatureRef) and len(data) < 4096
    assert isinstance(decode(FEATURE_DECODER, data), FeatureRef)
    back = await unpack(js, data)
    assert back == big
    assert_same(from_record(back, expect=origin), big_feature)
    # The same record again is the same object (content-addressed), stored once.
    again, ref_again = await pack(js, big, max_payload)
    assert again == data and ref_again == ref
    store = await feature_store(js, backbone)
    assert [o.name for o in await store.list() if not o.deleted] == [ref.object_name]

    # A reference whose object is gone, or not the referenced bytes, is refused.
    forged = encode(msgspec.structs.replace(ref, sha256="0" * 64))
    with pytest.raises(FeatureTransportError, match="do not match"):
        await unpack(js, forged)
    await store.delete(ref.object_name)
    with pytest.raises(FeatureTransportError, match="is gone"):
        await unpack(js, data)
    elsewhere = encode(
        FeatureRef(
            **{**{f: getattr(ref, f) for f in ref.__struct_fields__}, "bucket": "checkpoints"}
        )
    )
    with pytest.raises(FeatureTransportError, match="not backbone"):
        await unpack(js, elsewhere)
