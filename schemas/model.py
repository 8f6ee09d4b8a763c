"""Model-facing configuration and samples shared by the bus and the model core.

Schema evolution (applies to every Struct in ``schemas/``): new fields get defaults and go
last; fields are never reordered, renamed or retyped; a removed field's name is not reused.
Decoders ignore unknown fields, so a service of the previous version reads a newer writer's
messages and records (rolling upgrades); user-facing specs are the strict ones (pydantic,
unknown keys rejected). Golden encodings in ``tests/golden/`` catch accidental changes.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.tensor import Tensor

HeadKind = Literal["oft", "discrete", "flow"]


class HeadConfig(msgspec.Struct, frozen=True):
    """A tenant's action module: what it predicts and how big it is."""

    kind: HeadKind
    #: Dimension of one action vector (e.g. 7 for xyz + rpy + gripper).
    action_dim: int
    #: Number of future actions predicted at once (action chunking).
    chunk_len: int = 1
    #: Dimension of the tenant's proprioceptive state vector (0 = none).
    proprio_dim: int = 0
    #: Width of the head's internal layers.
    hidden_dim: int = 64
    #: Depth (attention blocks for oft/flow, MLP layers for discrete).
    num_layers: int = 1
    #: Bins per action dimension (discrete head only); actions are assumed in [-1, 1].
    num_bins: int = 32
    #: Euler steps when sampling (flow head only).
    flow_steps: int = 8
    #: Also build a value head (PPO).
    value_head: bool = False
    #: Read the backbone's features. False: a blind policy, acting on proprio alone (its
    #: prefix tokens are zeroed) -- the baseline a vision result is measured against.
    vision: bool = True

    def __post_init__(self) -> None:
        for name in (
            "action_dim",
            "chunk_len",
            "hidden_dim",
            "num_layers",
            "num_bins",
            "flow_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"HeadConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.proprio_dim < 0:
            raise ValueError(f"HeadConfig.proprio_dim must be >= 0, got {self.proprio_dim}")


class OptimizerConfig(msgspec.Struct, frozen=True):
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    #: Max global grad norm; 0 disables clipping.
    grad_clip: float = 1.0
    warmup_steps: int = 0
    #: Steps of the cosine schedule; 0 means constant lr after warmup.
    total_steps: int = 0
    min_lr_ratio: float = 0.0


class Observation(msgspec.Struct, frozen=True):
    """One tenant sample as the robot sees it, before normalisation.

    ``images`` are 1-3 camera views, each ``uint8`` HxWx3 of any size; ``proprio`` is a float32
    vector of the tenant's own dimension (shape ``(P,)``, possibly ``(0,)``).
    """

    images: list[Tensor]
    instruction: str
    proprio: Tensor
