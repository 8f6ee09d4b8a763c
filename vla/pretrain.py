"""Pretraining a backbone to see: supervised by what the simulator knows, no human labels.

No pretrained VLM can be downloaded here, and a random-weight backbone's features barely say
where things are. :func:`pretrain` trains the whole (tiny) VLM so that its image tokens, mean
pooled at the feature layer services read, predict the privileged positions the simulator
exposes for each rendered frame (object, goal, tool), standardised -- a regression head that
is thrown away afterwards. :func:`save_pretrained` writes a normal ``save_pretrained``
checkpoint with ``joynexus_pretrain.json`` saying what it was trained on; services load it
with ``--backbone DIR`` and keep it frozen like any other.

Whether the frozen features then carry position is measured, not assumed: :func:`probe_r2`
fits a ridge-regression probe from the pooled features to the positions on training frames
and scores it (R^2 per target) on held-out frames, before and after.

Frames come from ``services.envs.frames.collect_frames`` (this module imports no simulator).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vla.backbone import Backbone
from vla.normalize import Normaliser

#: File in a pretrained checkpoint directory that records how it was made.
PRETRAIN_RECORD = "joynexus_pretrain.json"
#: Text budget of the instruction during pretraining (as the services' default).
_TOKEN_BUDGET = 16
_FEATURE_BATCH = 128
#: A target whose spread over the training frames is below this is constant: left out.
CONSTANT_SPREAD = 1e-3


@dataclass(frozen=True)
class FrameSet:
    """Rendered frames and, for each, the true positions the simulator knew."""

    #: uint8 ``(N, V, H, W, 3)`` camera frames.
    images_N_V_H_W_3: np.ndarray
    #: The task instruction of each frame.
    instructions: list[str]
    #: float32 ``(N, K)`` regression targets, ``target_names`` naming the K columns.
    targets_N_K: np.ndarray
    target_names: tuple[str, ...]
    #: The envs the frames were rendered from.
    env_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        n = len(self.images_N_V_H_W_3)
        if self.images_N_V_H_W_3.dtype != np.uint8 or self.images_N_V_H_W_3.ndim != 5:
            raise ValueError(
                f"images_N_V_H_W_3: expected uint8 (N, V, H, W, 3), got "
                f"{self.images_N_V_H_W_3.dtype} {self.images_N_V_H_W_3.shape}"
            )
        if len(self.instructions) != n or self.targets_N_K.shape[0] != n:
            raise ValueError(
                f"{n} frames but {len(self.instructions)} instructions and "
                f"{self.targets_N_K.shape[0]} target rows"
            )
        if self.targets_N_K.shape[1:] != (len(self.target_names),):
            raise ValueError(
                f"targets_N_K has {self.targets_N_K.shape[1:]} columns for names "
                f"{self.target_names}"
            )

    def __len__(self) -> int:
        return len(self.images_N_V_H_W_3)

    def subset(self, rows: np.ndarray) -> FrameSet:
        """The frames at ``rows``."""
        return FrameSet(
            self.images_N_V_H_W_3[rows],
            [self.instructions[i] for i in rows],
            self.targets_N_K[rows],
            self.target_names,
            self.env_ids,
        )

    def columns(self, keep_K: np.ndarray) -> FrameSet:
        """The same frames with only the target columns where ``keep_K`` is True."""
        return FrameSet(
            self.images_N_V_H_W_3,
            self.instructions,
            self.targets_N_K[:, keep_K],
            tuple(n for n, k in zip(self.target_names, keep_K, strict=True) if k),
            self.env_ids,
        )

    @staticmethod
    def concat(sets: Sequence[FrameSet]) -> FrameSet:
        """Frames of several envs as one set; their targets must have the same names."""
        names = {s.target_names for s in sets}
        if len(names) != 1:
            raise ValueError(f"frame sets have different targets: {sorted(names)}")
        return FrameSet(
            np.concatenate([s.images_N_V_H_W_3 for s in sets]),
            [i for s in sets for i in s.instructions],
            np.concatenate([s.targets_N_K for s in sets]),
            sets[0].target_names,
            tuple(e for s in sets for e in s.env_ids),
        )


@dataclass(frozen=True)
class PretrainConfig:
    """How long and how fast to pretrain."""

    steps: int = 1500
    batch_size: int = 64
    lr: float = 1e-3
    #: Linear warmup of the learning rate over this share of the steps (a randomly
    #: initialised transformer at full rate from step one can diverge).
    warmup_share: float = 0.1
    #: Max global gradient norm.
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"steps, batch_size and lr must be positive, got {self}")


@dataclass
class PretrainReport:
    """What a pretraining run did and measured; written to :data:`PRETRAIN_RECORD`."""

    base: str
    env_ids: list[str]
    train_frames: int
    heldout_frames: int
    target_names: list[str]
    config: dict[str, Any]
    #: Targets left out: (nearly) constant over the training frames, nothing to learn or probe
    #: (e.g. a goal drawn on the table always has the same height).
    constant_targets: list[str] = field(default_factory=list)
    #: Held-out probe R^2 per target, with the weights before and after.
    probe_r2_before: dict[str, float] = field(default_factory=dict)
    probe_r2_after: dict[str, float] = field(default_factory=dict)
    #: Mean squared error of the standardised targets, first and last 50 steps.
    loss_first: float = math.nan
    loss_last: float = math.nan
    wall_s: float = 0.0


def _pooled_features(
    backbone: Backbone, normaliser: Normaliser, frames: FrameSet, rows: np.ndarray
) -> torch.Tensor:
    """``[B, D]``: the feature layer's hidden states averaged over image tokens."""
    images = frames.images_N_V_H_W_3[rows]
    inputs = normaliser.normalise_arrays(
        images,
        [frames.instructions[i] for i in rows],
        np.zeros((len(rows), 0), np.float32),
    )
    kwargs = backbone.model_kwargs(inputs)
    hidden_B_T_D = backbone.hidden_states(kwargs).float()
    image_B_T_1 = backbone.image_token_mask(kwargs["input_ids"]).unsqueeze(-1).float()
    return (hidden_B_T_D * image_B_T_1).sum(1) / image_B_T_1.sum(1)


def pooled_features(backbone: Backbone, frames: FrameSet) -> np.ndarray:
    """float64 ``(N, D)`` pooled image-token features of every frame, without gradients."""
    normaliser = Normaliser(backbone, frames.images_N_V_H_W_3.shape[1], _TOKEN_BUDGET)
    parts = []
    with torch.inference_mode():
        for start in range(0, len(frames), _FEATURE_BATCH):
            rows = np.arange(start, min(start + _FEATURE_BATCH, len(frames)))
            parts.append(_pooled_features(backbone, normaliser, frames, rows).double().numpy())
    return np.concatenate(parts)


def probe_r2(
    features_train_N_D: np.ndarray,
    targets_train_N_K: np.ndarray,
    features_test_M_D: np.ndarray,
    targets_test_M_K: np.ndarray,
    ridge: float = 1e-2,
) -> np.ndarray:
    """Held-out R^2 per target of a ridge-regression probe (standardised features + bias)."""
    mean_D = features_train_N_D.mean(0)
    # A feature nearly constant on the training frames must not be blown up by its tiny
    # spread (held-out frames would then read as huge values): floor the scale.
    spread_D = features_train_N_D.std(0)
    std_D = np.maximum(spread_D, 1e-2 * float(spread_D.mean()) + 1e-8)
    x = np.c_[(features_train_N_D - mean_D) / std_D, np.ones(len(features_train_N_D))]
    x_test = np.c_[(features_test_M_D - mean_D) / std_D, np.ones(len(features_test_M_D))]
    weights = np.linalg.solve(
        x.T @ x + ridge * len(x) * np.eye(x.shape[1]), x.T @ targets_train_N_K
    )
    residual = ((x_test @ weights - targets_test_M_K) ** 2).sum(0)
    spread = ((targets_test_M_K - targets_test_M_K.mean(0)) ** 2).sum(0)
    return np.asarray(1.0 - residual / np.maximum(spread, 1e-12))


def _probe(backbone: Backbone, train: FrameSet, heldout: FrameSet) -> dict[str, float]:
    r2_K = probe_r2(
        pooled_features(backbone, train),
        train.targets_N_K,
        pooled_features(backbone, heldout),
        heldout.targets_N_K,
    )
    return {name: round(float(v), 4) for name, v in zip(train.target_names, r2_K, strict=True)}


def pretrain(
    backbone: Backbone,
    train: FrameSet,
    heldout: FrameSet,
    config: PretrainConfig,
    *,
    base: str,
    on_step: Callable[[int, float], None] | None = None,
) -> PretrainReport:
    """Train ``backbone``'s weights in place to predict ``train``'s targets from its pooled
    image-token features; probe before and after on ``heldout``. The backbone is frozen
    again (eval mode, no gradients) when this returns, also on error."""
    if backbone.feature_layer != backbone.model.config.get_text_config().num_hidden_layers:
        raise ValueError(
            "pretrain a backbone loaded at its final feature layer (feature_layer=-1); one cut "
            "at an earlier layer has dropped the layers above it"
        )
    started = time.monotonic()
    varying_K = train.targets_N_K.std(0) > CONSTANT_SPREAD
    if not varying_K.any():
        raise ValueError(f"every target is constant over the training frames: {train.target_names}")
    constant = [n for n, v in zip(train.target_names, varying_K, strict=True) if not v]
    train, heldout = train.columns(varying_K), heldout.columns(varying_K)
    report = PretrainReport(
        base=base,
        env_ids=sorted(set(train.env_ids)),
        train_frames=len(train),
        heldout_frames=len(heldout),
        target_names=list(train.target_names),
        config=asdict(config),
        constant_targets=constant,
    )
    report.probe_r2_before = _probe(backbone, train, heldout)
    mean_K = train.targets_N_K.mean(0)
    std_K = train.targets_N_K.std(0) + 1e-6
    targets_N_K = torch.as_tensor((train.targets_N_K - mean_K) / std_K, dtype=torch.float32)
    normaliser = Normaliser(backbone, train.images_N_V_H_W_3.shape[1], _TOKEN_BUDGET)
    generator = np.random.default_rng(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        regressor = nn.Linear(backbone.hidden_size, train.targets_N_K.shape[1])
    params = [p for p in backbone.model.parameters() if p.is_floating_point()]
    trained = [*params, *regressor.parameters()]
    optimizer = torch.optim.AdamW(trained, lr=config.lr)
    warmup_steps = max(1, round(config.warmup_share * config.steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup_steps)
    )
    losses: list[float] = []
    backbone.model.requires_grad_(True)
    backbone.model.train()
    try:
        for step in range(config.steps):
            rows = generator.integers(0, len(train), config.batch_size)
            pooled_B_D = _pooled_features(backbone, normaliser, train, rows)
            loss = nn.functional.mse_loss(regressor(pooled_B_D), targets_N_K[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, config.grad_clip)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(step, losses[-1])
    finally:
        backbone.model.requires_grad_(False)
        backbone.model.eval()
    report.loss_first = float(np.mean(losses[:50]))
    report.loss_last = float(np.mean(losses[-50:]))
    report.probe_r2_after = _probe(backbone, train, heldout)
    report.wall_s = round(time.monotonic() - started, 1)
    return report


def save_pretrained(backbone: Backbone, out_dir: Path, report: PretrainReport) -> Path:
    """Write the backbone as a ``from_pretrained`` checkpoint directory with its record."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backbone.model.save_pretrained(out_dir)
    backbone.processor.save_pretrained(out_dir)
    (out_dir / PRETRAIN_RECORD).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return out_dir
