"""Backbone pretraining (vla.pretrain): the features learn where things are, measured by a
held-out linear probe, and the result is a checkpoint every service loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.envs.frames import collect_frames
from services.envs.sims import REACH2D_ID
from vla.backbone import Backbone
from vla.pretrain import (
    PRETRAIN_RECORD,
    FrameSet,
    PretrainConfig,
    pretrain,
    probe_r2,
    save_pretrained,
)

SIZE = 64


def squares(count: int, seed: int) -> FrameSet:
    """Frames of a small red square among three larger squares of other colours on a grey
    table, all at random places; targets: the red square's centre. Mean-pooled random
    features barely tell where the red one is among the others."""
    rng = np.random.default_rng(seed)
    images = np.full((count, 1, SIZE, SIZE, 3), 110, np.uint8)
    centres = rng.integers(6, SIZE - 6, (count, 4, 2))
    colours = [(40, 60, 200), (40, 170, 60), (220, 220, 220), (200, 30, 30)]
    for i in range(count):
        for (row, col), colour, half in zip(centres[i], colours, (5, 5, 5, 4), strict=True):
            images[i, 0, row - half : row + half, col - half : col + half] = colour
    return FrameSet(
        images,
        ["push the cube to the goal region"] * count,
        (centres[:, 3] / SIZE).astype(np.float32),
        ("row", "col"),
        ("squares",),
    )


def test_probe_scores_a_linear_signal_and_not_noise() -> None:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(400, 16))
    signal = features @ rng.normal(size=(16, 1))
    noise = rng.normal(size=(400, 1))
    r2 = probe_r2(
        features[:300], np.c_[signal, noise][:300], features[300:], np.c_[signal, noise][300:]
    )
    assert r2[0] > 0.99 and r2[1] < 0.1


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_pretraining_puts_position_into_the_features_and_saves_a_loadable_checkpoint(
    tmp_path: Path,
) -> None:
    backbone = Backbone.load("tiny")
    before = {k: v.clone() for k, v in backbone.model.state_dict().items()}
    losses: list[float] = []
    report = pretrain(
        backbone,
        squares(512, seed=0),
        squares(128, seed=1),
        PretrainConfig(steps=200, batch_size=32, lr=1e-3),
        base="tiny",
        on_step=lambda step, loss: losses.append(loss),
    )
    assert len(losses) == 200 and report.loss_last < 0.5 * report.loss_first
    r2_before = np.mean(list(report.probe_r2_before.values()))
    r2_after = np.mean(list(report.probe_r2_after.values()))
    # Measured: R^2 0.12 -> 0.96, loss 1.09 -> 0.07.
    assert r2_after > max(0.7, r2_before + 0.3), (report.probe_r2_before, report.probe_r2_after)
    # Frozen again: what services expect of a backbone.
    assert not any(p.requires_grad for p in backbone.model.parameters())
    assert not backbone.model.training

    out = save_pretrained(backbone, tmp_path / "seeing", report)
    record = json.loads((out / PRETRAIN_RECORD).read_text())
    assert record["base"] == "tiny" and record["env_ids"] == ["squares"]
    assert record["train_frames"] == 512 and record["config"]["steps"] == 200
    assert record["probe_r2_after"] == report.probe_r2_after
    assert record["constant_targets"] == []

    loaded = Backbone.load(out)
    assert loaded.backbone_id == "seeing"
    trained = backbone.model.state_dict()
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert any(not torch.equal(before[n], trained[n]) for n in before)


def test_pretraining_refuses_a_backbone_cut_below_its_last_layer() -> None:
    backbone = Backbone.load("tiny", feature_layer=1)
    with pytest.raises(ValueError, match="final feature layer"):
        pretrain(backbone, squares(8, 0), squares(8, 1), PretrainConfig(steps=1), base="tiny")


def test_constant_targets_are_left_out_and_all_constant_is_refused() -> None:
    frames = squares(64, 0)
    flat = FrameSet(
        frames.images_N_V_H_W_3,
        frames.instructions,
        np.c_[frames.targets_N_K, np.full(64, 0.001, np.float32)],
        ("row", "col", "table_height"),
        ("squares",),
    )
    report = pretrain(
        Backbone.load("tiny"), flat, flat, PretrainConfig(steps=2, batch_size=4), base="tiny"
    )
    assert report.constant_targets == ["table_height"]
    assert report.target_names == ["row", "col"] == list(report.probe_r2_after)
    level = flat.columns(np.array([False, False, True]))
    with pytest.raises(ValueError, match="every target is constant"):
        pretrain(Backbone.load("tiny"), level, level, PretrainConfig(steps=1), base="tiny")


def test_bad_configs_and_frame_sets_are_refused() -> None:
    with pytest.raises(ValueError, match="steps, batch_size and lr"):
        PretrainConfig(steps=0)
    frames = squares(4, 0)
    with pytest.raises(ValueError, match="instructions"):
        FrameSet(frames.images_N_V_H_W_3, ["x"], frames.targets_N_K, ("row", "col"), ("s",))
    with pytest.raises(ValueError, match="different targets"):
        FrameSet.concat(
            [
                frames,
                FrameSet(
                    frames.images_N_V_H_W_3,
                    frames.instructions,
                    frames.targets_N_K,
                    ("a", "b"),
                    ("s",),
                ),
            ]
        )


def test_collect_frames_keeps_each_step_with_the_true_positions() -> None:
    frames = collect_frames(REACH2D_ID, 3, seed=5, image_size=32)
    assert frames.env_ids == (REACH2D_ID,)
    assert frames.target_names == ("agent_xy[0]", "agent_xy[1]", "target_xy[0]", "target_xy[1]")
    assert frames.images_N_V_H_W_3.shape[1:] == (1, 32, 32, 3)
    assert len(frames) == len(frames.instructions) == len(frames.targets_N_K) >= 3
    assert np.isfinite(frames.targets_N_K).all()
    # The target does not move within an episode; the agent does.
    assert len(np.unique(frames.targets_N_K[:, 2])) <= 3 < len(np.unique(frames.targets_N_K[:, 0]))
