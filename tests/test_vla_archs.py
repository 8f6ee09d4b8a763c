"""Five VLM architectures behind one generic backbone path: tiny real models, all on CPU."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded, ever

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from schemas.model import Observation
from schemas.tensor import Tensor
from tests.numerics import assert_rounding_apart
from vla.backbone import Backbone
from vla.feature import PIXELS_U8, ModelInputs
from vla.normalize import Normaliser
from vla.tiny import SPECS, init_checkpoint

torch.set_num_threads(1)

ARCHS = ["tiny", "tiny-llava", "tiny-paligemma", "tiny-idefics2", "tiny-llava-next"]


def obs(size: tuple[int, int], instruction: str, seed: int) -> Observation:
    rng = np.random.default_rng(seed)
    image = Tensor.from_numpy(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
    return Observation([image], instruction, Tensor.from_numpy(np.zeros(4, np.float32)))


def samples() -> list[Observation]:
    return [
        obs((48, 80), "pick up the red cube", 0),
        obs((64, 64), "open the drawer", 1),
        obs((90, 30), "push the blue block to the left", 2),
    ]


@pytest.mark.parametrize("name", ARCHS)
def test_checkpoint_loads_with_features_identical_to_the_in_process_model(
    name: str, tmp_path: Path
) -> None:
    built = Backbone.load(name)
    assert built.model_type == SPECS[name].arch
    assert built.num_params < 1_000_000
    loaded = Backbone.load(init_checkpoint(name, tmp_path / name))
    assert type(loaded.model) is type(built.model)
    assert loaded.image_block_ids == built.image_block_ids
    assert loaded.image_size == built.image_size == SPECS[name].image_size
    assert loaded.layout.per_token == built.layout.per_token
    feat_built = built.encode(Normaliser(built, 2, 10).normalise(samples()))
    feat_loaded = loaded.encode(Normaliser(loaded, 2, 10).normalise(samples()))
    assert torch.equal(feat_loaded.prefix_B_T_D, feat_built.prefix_B_T_D)
    assert torch.isfinite(feat_built.prefix_B_T_D).all()


@pytest.mark.parametrize("name", ARCHS)
def test_views_sent_as_uint8_give_the_features_of_normalised_values(name: str) -> None:
    """What a head-only role sends the backbone role: resized uint8 views, a quarter of the
    bytes, normalised by the backbone into the very bits the normaliser would have made."""
    bb = Backbone.load(name)
    values = Normaliser(bb, 2, 10).normalise(samples())
    raw = Normaliser(bb, 2, 10, uint8_pixels=True).normalise(samples())
    assert "pixel_values" not in raw.tensors and raw.tensors[PIXELS_U8].dtype == torch.uint8
    assert raw.tensors[PIXELS_U8].nbytes * 4 == values.tensors["pixel_values"].nbytes
    assert torch.equal(
        bb.model_kwargs(raw)["pixel_values"], bb.model_kwargs(values)["pixel_values"]
    )
    assert torch.equal(bb.encode(raw).prefix_B_T_D, bb.encode(values).prefix_B_T_D)
    raw.tensors[PIXELS_U8] = raw.tensors[PIXELS_U8].to(torch.float32)
    with pytest.raises(ValueError, match=r"pixels_u8: expected uint8 \(3, 2, "):
        bb.encode(raw)


@pytest.mark.parametrize("name", ARCHS)
def test_features_equal_transformers_hidden_states_at_the_feature_layer(name: str) -> None:
    full = Backbone.load(name, feature_layer=-1)
    cut = Backbone.load(name, feature_layer=1)
    inputs = Normaliser(full, 1, 8).normalise(samples()[:2])
    kwargs = full.model_kwargs(inputs)
    with torch.inference_mode():
        ref = full.model.model(**kwargs, output_hidden_states=True, use_cache=False)
    torch.testing.assert_close(full.encode(inputs).prefix_B_T_D, ref.hidden_states[-1])
    torch.testing.assert_close(cut.encode(inputs).prefix_B_T_D, ref.hidden_states[1])


@pytest.mark.parametrize("name", ARCHS)
def test_a_head_trained_on_the_features_has_a_falling_loss(name: str) -> None:
    bb = Backbone.load(name)
    feat = bb.encode(Normaliser(bb, 1, 8).normalise(samples()))
    mask_B_T_1 = feat.mask_B_T.unsqueeze(-1).float()
    pooled_B_D = (feat.prefix_B_T_D * mask_B_T_1).sum(1) / mask_B_T_1.sum(1)
    gen = torch.Generator().manual_seed(0)
    # A realisable target (a fixed projection of the centred features): the loss can only fall
    # if the features carry the signal through to the head.
    centred_B_D = pooled_B_D - pooled_B_D.mean(0)
    target_B_A = centred_B_D @ torch.randn(bb.hidden_size, 2, generator=gen)
    target_B_A = target_B_A / target_B_A.std()
    head = nn.Linear(bb.hidden_size, 2)
    nn.init.normal_(head.weight, std=0.02, generator=gen)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = (head(pooled_B_D) - target_B_A).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.parametrize("name", ARCHS)
def test_grouped_forward_equals_serial_forwards(name: str) -> None:
    bb = Backbone.load(name)
    norm = Normaliser(bb, num_views=2, token_budget=12)
    a, b, c = (norm.normalise([s]) for s in samples())
    grouped = bb.encode(ModelInputs.concat([a, b, c]))
    parts = grouped.split([1, 1, 1], [a.proprio_B_P, b.proprio_B_P, c.proprio_B_P])
    for part, alone in zip(parts, (bb.encode(x) for x in (a, b, c)), strict=True):
        assert_rounding_apart(part.prefix_B_T_D, alone.prefix_B_T_D, name)
        assert torch.equal(part.mask_B_T, alone.mask_B_T)


def test_a_checkpoint_whose_processor_cannot_load_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    ckpt = init_checkpoint("tiny-llava", tmp_path / "broken")
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="its processor cannot be loaded here"):
        Backbone.load(ckpt)
