"""What the low-level API's calls take and give (:mod:`clients.lowlevel`): the batch, the
optimizer step's hyper-parameters, a call's output, and the errors a call's future raises."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class CallError(RuntimeError):
    """A call the trainer did not apply (``call`` is its number), or one that could not be
    sent; ``retryable`` whether the same work sent again may succeed."""

    def __init__(self, message: str, *, call: int, retryable: bool) -> None:
        super().__init__(message)
        self.call = call
        self.retryable = retryable


class SessionClosed(CallError):
    """The session ended (closed, cancelled, its lease expired, or it failed) before the
    call was answered."""


@dataclass(frozen=True)
class AdamParams:
    """One ``optim_step``'s AdamW hyper-parameters (Tinker's names)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: Max global norm of the accumulated gradients; 0 disables clipping.
    grad_clip: float = 0.0


@dataclass(frozen=True)
class VLABatch:
    """A batch of VLA samples for ``forward`` / ``forward_backward``.

    ``images`` uint8 (B, V, H, W, 3); ``instructions`` B strings; ``proprio`` float32 (B, P)
    (P = the head's ``proprio_dim``); ``actions`` float32 (B, C, A) targets (C = chunk_len,
    A = action_dim; for a policy-gradient loss, the actions taken). ``advantages`` and
    ``old_log_probs`` float32 (B,) for ``loss_fn="ppo"``."""

    images: np.ndarray
    instructions: Sequence[str]
    proprio: np.ndarray
    actions: np.ndarray
    advantages: np.ndarray | None = None
    old_log_probs: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.images.ndim != 5 or self.images.dtype != np.uint8:
            raise ValueError(
                f"images: expected uint8 (B, V, H, W, 3), got {self.images.dtype} "
                f"{self.images.shape}"
            )
        batch = self.images.shape[0]
        if len(self.instructions) != batch:
            raise ValueError(f"instructions: {len(self.instructions)} for {batch} samples")
        for name in ("proprio", "actions"):
            value = getattr(self, name)
            if value.shape[0] != batch:
                raise ValueError(f"{name}: {value.shape[0]} rows for {batch} samples")

    @property
    def size(self) -> int:
        return int(self.images.shape[0])


@dataclass(frozen=True)
class CallOutput:
    """A call's answer: ``loss`` (forward calls; NaN otherwise), its ``metrics`` and the
    policy ``version`` a save committed or a load restored (0 otherwise)."""

    call: int
    op: str
    metrics: dict[str, float]
    version: int = 0

    @property
    def loss(self) -> float:
        return self.metrics.get("loss", math.nan)
