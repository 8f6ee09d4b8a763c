"""Backbone, tiny models and normaliser: real tiny transformers models, no mocks, all on CPU."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded, ever

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from schemas.model import Observation
from schemas.tensor import Tensor
from vla.backbone import Backbone, _id_from_path
from vla.feature import ModelInputs
from vla.normalize import Normaliser
from vla.tiny import SPECS, TINY_NAMES, build_tiny, build_tokenizer, init_checkpoint

torch.set_num_threads(1)

_BACKBONES: dict[str, Backbone] = {}


def backbone(name: str) -> Backbone:
    """One resident backbone per tiny name for the whole module (they are frozen)."""
    if name not in _BACKBONES:
        _BACKBONES[name] = Backbone.load(name)
    return _BACKBONES[name]


def obs(
    sizes: list[tuple[int, int]], instruction: str, proprio_dim: int = 7, seed: int = 0
) -> Observation:
    rng = np.random.default_rng(seed)
    images = [Tensor.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    proprio = rng.standard_normal(proprio_dim).astype(np.float32)
    return Observation(images, instruction, Tensor.from_numpy(proprio))


def test_tiny_models_build_deterministically_with_stated_sizes() -> None:
    assert TINY_NAMES[:3] == ("tiny", "tiny-224", "tiny-llava")
    counts = {}
    for name in TINY_NAMES:
        model, processor = build_tiny(name)
        again, _ = build_tiny(name)
        counts[name] = sum(p.numel() for p in model.parameters())
        pairs = zip(model.parameters(), again.parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        assert model.config.vision_config.image_size == SPECS[name].image_size
        assert processor.tokenizer is not None
    # PITFALLS.md: the tiny Idefics3 measured 0.54 M params; the backbone must not shrink.
    assert 500_000 < counts["tiny"] < 600_000
    assert counts["tiny-224"] > 3 * counts["tiny"]
    assert 400_000 < counts["tiny-llava"] < 700_000
    # Tokenizer training is deterministic and covers every special the processors need.
    tok_a, tok_b = build_tokenizer(), build_tokenizer()
    assert tok_a.get_vocab() == tok_b.get_vocab()
    for special in ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"):
        assert isinstance(tok_a.convert_tokens_to_ids(special), int)
    assert tok_a.pad_token_id is not None and tok_a.bos_token_id is not None


def test_unknown_tiny_name_and_missing_directory_raise() -> None:
    with pytest.raises(ValueError, match="unknown tiny model 'huge'"):
        build_tiny("huge")
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a tiny model"):
        Backbone.load("/nonexistent/checkpoint")
    with pytest.raises(ValueError, match="dtype must be one of"):
        Backbone.load("tiny", dtype="float8")


@pytest.mark.parametrize("name", ["tiny", "tiny-llava"])
def test_checkpoint_round_trip_gives_identical_features(name: str, tmp_path: Path) -> None:
    ckpt = init_checkpoint(name, tmp_path / f"My_{name}.v1")
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    loaded = Backbone.load(ckpt)
    built = backbone(name)
    assert loaded.backbone_id == f"my-{name}-v1"
    assert type(loaded.model) is type(built.model)
    assert type(loaded.processor) is type(built.processor)
    assert loaded.image_block_ids == built.image_block_ids
    assert loaded.num_params == built.num_params

    samples = [obs([(48, 80)], "pick up the red cube"), obs([(64, 64)], "open the drawer", seed=1)]
    # Same key shape on both (ids differ), so build inputs per backbone.
    feat_loaded = loaded.encode(Normaliser(loaded, 1, 12).normalise(samples))
    feat_built = built.encode(Normaliser(built, 1, 12).normalise(samples))
    assert torch.equal(feat_loaded.prefix_B_T_D, feat_built.prefix_B_T_D)
    assert torch.equal(feat_loaded.mask_B_T, feat_built.mask_B_T)


def test_backbone_id_from_hub_snapshot_path_names_the_repo() -> None:
    snapshot = Path("/cache/models--HuggingFaceTB--SmolVLM-256M-Instruct/snapshots/0123abcd")
    assert _id_from_path(snapshot) == "huggingfacetb--smolvlm-256m-instruct"
    assert _id_from_path(Path("/ckpt/___")) == "backbone"


def test_backbone_is_frozen_and_a_head_backprops_through_its_features() -> None:
    bb = backbone("tiny")
    assert not bb.model.training
    assert not any(p.requires_grad for p in bb.model.parameters())
    inputs = Normaliser(bb, 2, 8).normalise(
        [obs([(64, 64), (32, 32)], "stack the cubes"), obs([(100, 50)], "push", seed=3)]
    )
    feat = bb.encode(inputs)
    assert feat.prefix_B_T_D.dtype == torch.float32
    assert not feat.prefix_B_T_D.is_inference()  # inference tensors cannot be saved for backward
    assert not feat.prefix_B_T_D.requires_grad

    head = nn.Linear(bb.hidden_size, 4)
    mask_B_T_1 = feat.mask_B_T.unsqueeze(-1).float()
    pooled_B_D = (feat.prefix_B_T_D * mask_B_T_1).sum(1) / mask_B_T_1.sum(1)
    loss = head(pooled_B_D).pow(2).mean() + head(feat.prefix_B_T_D).mean()
    loss.backward()
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()
    assert head.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in bb.model.parameters())


def test_feature_layer_equals_transformers_hidden_states_and_drops_unused_layers() -> None:
    model, _ = build_tiny("tiny")
    inputs = Normaliser(backbone("tiny"), 1, 6).normalise([obs([(64, 64)], "lift the mug")])
    with torch.inference_mode():
        ref = model.model(**inputs.tensors, output_hidden_states=True, use_cache=False)
    hidden = ref.hidden_states
    assert len(hidden) == 3  # embeddings + 2 layers (the last one normed)
    for layer in (-1, 2, -2, 1, 0):
        bb = Backbone.load("tiny", feature_layer=layer)
        feat = bb.encode(inputs)
        torch.testing.assert_close(feat.prefix_B_T_D, hidden[layer], rtol=0, atol=1e-6)
        decoder = bb.model.model.text_model
        # Layer 0 stays (unrun) for feature_layer 0; nothing above the feature layer is kept.
        assert len(decoder.layers) == max(bb.feature_layer, 1)
        calls = torch.zeros(())
        decoder.norm.register_forward_hook(lambda *_, c=calls: c.add_(1))
        bb.encode(inputs)
        assert int(calls) == (1 if bb.feature_layer == 2 else 0)  # the forward stopped early
    with pytest.raises(ValueError, match="feature_layer 3 out of range"):
        Backbone.load("tiny", feature_layer=3)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_normalised_shapes_are_identical_across_sizes_views_and_instructions(name: str) -> None:
    bb = backbone(name)
    norm = Normaliser(bb, num_views=3, token_budget=10)
    assert norm.key.backbone_id == name and norm.key.image_size == bb.image_size
    batches = [
        norm.normalise([obs([(48, 80)], "pick up the red cube")]),
        norm.normalise([obs([(480, 640), (64, 64)], "", proprio_dim=3)]),
        norm.normalise([obs([(bb.image_size, bb.image_size)] * 3, "a " * 40, seed=4)]),
    ]
    s = bb.image_size
    for b in batches:
        assert b.key == norm.key
        assert b.tensors["input_ids"].shape == (1, norm.seq_len)
        assert b.tensors["attention_mask"].shape == (1, norm.seq_len)
        assert b.tensors["pixel_values"].shape == (1, 3, 3, s, s)
        assert b.tensors["pixel_values"].dtype == torch.float32
    assert norm.seq_len == 1 + 3 * bb.image_token_count + 10
    heads = [b.tensors["input_ids"][0, : norm.seq_len - 10] for b in batches]
    assert all(torch.equal(h, heads[0]) for h in heads)
    # Real-token counts: empty instruction -> only the image prefix; long one -> full budget.
    real = [int(b.tensors["attention_mask"].sum()) for b in batches]
    assert real[1] == norm.seq_len - 10 and real[2] == norm.seq_len
    assert batches[2].tensors["attention_mask"][0, -1] == 1  # truncated, not padded


@pytest.mark.parametrize("name", TINY_NAMES)
def test_grouped_forward_equals_separate_forwards(name: str) -> None:
    bb = backbone(name)
    norm = Normaliser(bb, num_views=2, token_budget=12)
    a = norm.normalise([obs([(48, 80)], "pick up the red cube"), obs([(64, 64)] * 2, "go", seed=1)])
    b = norm.normalise([obs([(30, 200), (90, 90)], "close the drawer now", proprio_dim=7, seed=2)])
    grouped = bb.encode(ModelInputs.concat([a, b]))
    parts = grouped.split([a.batch_size, b.batch_size], [a.proprio_B_P, b.proprio_B_P])
    for part, alone in zip(parts, (bb.encode(a), bb.encode(b)), strict=True):
        torch.testing.assert_close(part.prefix_B_T_D, alone.prefix_B_T_D, rtol=0, atol=1e-5)
        assert torch.equal(part.mask_B_T, alone.mask_B_T)
        assert torch.equal(part.proprio_B_P, alone.proprio_B_P)


def test_pixels_and_ids_match_the_processor_for_native_size_images() -> None:
    """Our fast path reproduces the HF processor exactly where no resize is involved."""
    for name in ("tiny", "tiny-llava"):
        bb = backbone(name)
        s = bb.image_size
        sample = obs([(s, s), (s, s)], "place the cup in the sink", seed=5)
        instruction_ids = bb.tokenizer(sample.instruction, add_special_tokens=False).input_ids
        norm = Normaliser(bb, num_views=2, token_budget=len(instruction_ids))
        ours = norm.normalise([sample])
        images = [t.to_numpy() for t in sample.images]
        image_token: str = bb.processor.image_token  # type: ignore[attr-defined]
        prompt = bb.tokenizer.bos_token + image_token * 2 + sample.instruction
        ref = bb.processor(
            text=[prompt], images=[images], add_special_tokens=False, return_tensors="pt"
        )
        assert ours.tensors["input_ids"].tolist() == ref["input_ids"].tolist()
        ref_pixels = ref["pixel_values"].reshape(ours.tensors["pixel_values"].shape)
        torch.testing.assert_close(ours.tensors["pixel_values"], ref_pixels, rtol=0, atol=1e-6)


def test_fewer_views_repeat_the_last_view_and_arrays_path_matches() -> None:
    bb = backbone("tiny")
    norm = Normaliser(bb, num_views=3, token_budget=8)
    sample = obs([(40, 60)], "wipe the plate", seed=6)
    inputs = norm.normalise([sample])
    pixels = inputs.tensors["pixel_values"][0]
    assert torch.equal(pixels[0], pixels[1]) and torch.equal(pixels[0], pixels[2])

    arrays = norm.normalise_arrays(
        sample.images[0].to_numpy()[None, None],
        [sample.instruction],
        sample.proprio.to_numpy()[None],
    )
    for k, v in inputs.tensors.items():
        assert torch.equal(arrays.tensors[k], v), k
    assert torch.equal(arrays.proprio_B_P, inputs.proprio_B_P)


def test_instruction_text_cannot_inject_image_tokens() -> None:
    bb = backbone("tiny")
    norm = Normaliser(bb, num_views=1, token_budget=16)
    inputs = norm.normalise([obs([(64, 64)], "<image><image> <fake_token_around_image>")])
    image_id = bb.model.config.image_token_id
    count = int((inputs.tensors["input_ids"] == image_id).sum())
    assert count == bb.image_block_ids.count(image_id)
    assert bb.encode(inputs).prefix_B_T_D.shape[1] == norm.seq_len


def _float_image(o: Observation) -> Observation:
    return Observation([Tensor.from_numpy(np.zeros((8, 8, 3), np.float32))], "x", o.proprio)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            _float_image,
            r"obs\[0\]\.images\[0\]: expected uint8 image of shape \(H, W, 3\), got float32",
        ),
        (
            lambda o: Observation([Tensor.from_numpy(np.zeros((8, 8), np.uint8))], "x", o.proprio),
            r"obs\[0\]\.images\[0\]: expected uint8 image of shape \(H, W, 3\), got uint8 \(8, 8\)",
        ),
        (
            lambda o: Observation(
                [o.images[0], Tensor.from_numpy(np.zeros((8, 8, 4), np.uint8))], "x", o.proprio
            ),
            r"obs\[0\]\.images\[1\]: .*got uint8 \(8, 8, 4\)",
        ),
        (
            lambda o: Observation([o.images[0]] * 3, "x", o.proprio),
            r"obs\[0\]\.images: expected 1 to 2 views .* got 3",
        ),
        (
            lambda o: Observation([], "x", o.proprio),
            r"obs\[0\]\.images: expected 1 to 2 views .* got 0",
        ),
        (
            lambda o: Observation(o.images, "x", Tensor.from_numpy(np.zeros(3, np.float64))),
            r"obs\[0\]\.proprio: expected float32 vector of shape \(P,\), got float64",
        ),
        (
            lambda o: Observation(o.images, "x", Tensor.from_numpy(np.zeros((2, 3), np.float32))),
            r"obs\[0\]\.proprio: expected float32 vector of shape \(P,\), got float32 \(2, 3\)",
        ),
        (
            lambda o: Observation(o.images, "x", Tensor("uint8", (8, 8, 3), b"short")),
            r"obs\[0\]\.proprio: .*needs 192 bytes",
        ),
    ],
)
def test_bad_observations_raise_value_errors_naming_the_field(
    make: Callable[[Observation], Observation], message: str
) -> None:
    norm = Normaliser(backbone("tiny"), num_views=2, token_budget=4)
    with pytest.raises(ValueError, match=message):
        norm.normalise([make(obs([(16, 16)], "x"))])


def test_bad_batches_and_arguments_raise_value_errors() -> None:
    bb = backbone("tiny")
    norm = Normaliser(bb, num_views=2, token_budget=4)
    with pytest.raises(ValueError, match="obs_list is empty"):
        norm.normalise([])
    with pytest.raises(ValueError, match=r"obs\[1\]\.proprio: dim 3 differs from obs\[0\]"):
        norm.normalise([obs([(8, 8)], "a"), obs([(8, 8)], "b", proprio_dim=3)])
    with pytest.raises(ValueError, match="num_views must be an int >= 1"):
        Normaliser(bb, num_views=0, token_budget=4)
    with pytest.raises(ValueError, match="token_budget must be an int >= 1"):
        Normaliser(bb, num_views=1, token_budget=0)
    images = np.zeros((2, 1, 8, 8, 3), np.uint8)
    proprio = np.zeros((2, 7), np.float32)
    with pytest.raises(ValueError, match=r"images_B_V_H_W_3: expected uint8 .* got float32"):
        norm.normalise_arrays(images.astype(np.float32), ["a", "b"], proprio)
    with pytest.raises(ValueError, match=r"images_B_V_H_W_3: expected 1 to 2 views .* got 3"):
        norm.normalise_arrays(np.zeros((2, 3, 8, 8, 3), np.uint8), ["a", "b"], proprio)
    with pytest.raises(ValueError, match=r"instructions: expected 2 str, got 1"):
        norm.normalise_arrays(images, ["a"], proprio)
    with pytest.raises(ValueError, match=r"proprio_B_P: expected float32 array of shape \(2, P\)"):
        norm.normalise_arrays(images, ["a", "b"], proprio[:1])
    # Inputs normalised for another backbone are refused, not silently mis-encoded.
    other = Normaliser(backbone("tiny-llava"), num_views=2, token_budget=4)
    with pytest.raises(ValueError, match="do not belong to backbone 'tiny'"):
        bb.encode(other.normalise([obs([(8, 8)], "a")]))


def test_tiny_224_encodes_through_the_same_interface() -> None:
    bb = backbone("tiny-224")
    assert (bb.image_size, bb.hidden_size) == (224, 256)
    assert bb.image_token_count == 3 + (224 // 16) ** 2 // 4  # wrappers + pixel-shuffled patches
    norm = Normaliser(bb, num_views=2, token_budget=16)
    feat = bb.encode(norm.normalise([obs([(480, 640), (96, 128)], "pick up the can")]))
    assert feat.prefix_B_T_D.shape == (1, norm.seq_len, 256)
    assert torch.isfinite(feat.prefix_B_T_D).all()


def test_smolvlm_style_checkpoint_with_image_splitting_on_still_gives_one_block_per_view(
    tmp_path: Path,
) -> None:
    """Real SmolVLM processors ship with splitting on and a 4x larger resize edge."""
    ckpt = init_checkpoint("tiny", tmp_path / "smolvlm-like")
    config_path = ckpt / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["image_processor"]["do_image_splitting"] = True
    config["image_processor"]["size"] = {"longest_edge": 4 * 64}
    config_path.write_text(json.dumps(config))
    loaded = Backbone.load(ckpt)
    assert loaded.processor.image_processor.do_image_splitting  # the checkpoint is unchanged
    assert loaded.image_block_ids == backbone("tiny").image_block_ids
    norm = Normaliser(loaded, num_views=2, token_budget=8)
    feat = loaded.encode(norm.normalise([obs([(300, 400)], "pick up the red cube")]))
    assert feat.prefix_B_T_D.shape == (1, norm.seq_len, loaded.hidden_size)


def test_bfloat16_backbone_returns_float32_features_close_to_float32() -> None:
    bb16 = Backbone.load("tiny", dtype="bfloat16")
    assert bb16.dtype == torch.bfloat16
    inputs = Normaliser(backbone("tiny"), 1, 8).normalise([obs([(64, 64)], "lift the can")])
    feat16 = bb16.encode(inputs)
    feat32 = backbone("tiny").encode(inputs)
    assert feat16.prefix_B_T_D.dtype == torch.float32
    assert not feat16.prefix_B_T_D.is_inference()
    torch.testing.assert_close(feat16.prefix_B_T_D, feat32.prefix_B_T_D, rtol=0.1, atol=0.1)


def test_uint8_views_are_the_normalisers_own_not_the_callers_array() -> None:
    """A uint8 batch is normalised only when the backbone reads it, so it must not share the
    caller's array: a caller that reuses its buffer before then does not change the batch."""
    bb = backbone("tiny")
    size = bb.image_size
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (2, 1, size, size, 3), dtype=np.uint8)
    proprio = np.zeros((2, 4), np.float32)
    raw = Normaliser(bb, 1, 8, uint8_pixels=True).normalise_arrays(images, ["a", "b"], proprio)
    before = bb.encode(raw).prefix_B_T_D
    images[:] = 0
    assert torch.equal(bb.encode(raw).prefix_B_T_D, before)
