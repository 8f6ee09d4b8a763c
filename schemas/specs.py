"""User-facing job specs (pydantic): what a tenant writes in ``sft.yaml``.

Unknown keys are rejected, and every error message names the field path
(``head.action_dim: ...``) so a tenant can fix the file without reading our code.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.ids import ID_PATTERN
from schemas.model import HeadConfig, OptimizerConfig

Id = Annotated[str, Field(pattern=ID_PATTERN)]


class JobSpecError(ValueError):
    """A job spec that cannot be accepted; the message names each bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HeadSpec(_Strict):
    """The tenant's action module."""

    kind: Literal["oft", "discrete", "flow"] = Field(description="Head architecture.")
    action_dim: int = Field(ge=1, le=64, description="Dimension of one action vector.")
    chunk_len: int = Field(1, ge=1, le=64, description="Actions predicted per step.")
    proprio_dim: int = Field(0, ge=0, le=256, description="Proprio state dim (0: none).")
    hidden_dim: int = Field(64, ge=8, le=4096)
    num_layers: int = Field(1, ge=1, le=16)
    num_bins: int = Field(32, ge=2, le=1024, description="Discrete head: bins per dim.")
    flow_steps: int = Field(8, ge=1, le=128, description="Flow head: Euler steps.")
    value_head: bool = False

    def to_config(self) -> HeadConfig:
        return HeadConfig(**self.model_dump())


class OptimizerSpec(_Strict):
    """AdamW with optional warmup and cosine decay."""

    lr: float = Field(1e-3, gt=0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="Max grad norm; 0 disables.")
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)

    def to_config(self, total_steps: int) -> OptimizerConfig:
        return OptimizerConfig(
            lr=self.lr,
            betas=self.betas,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
            warmup_steps=self.warmup_steps,
            total_steps=total_steps if self.schedule == "cosine" else 0,
            min_lr_ratio=self.min_lr_ratio,
        )


class SFTJobSpec(_Strict):
    """Supervised fine-tuning of a tenant's action module on an offline dataset."""

    kind: Literal["sft"]
    tenant: Id
    backbone: Id = Field("tiny", description="Backbone id served by a trainer.")
    dataset: str = Field(min_length=1, description="Path of a LeRobot-style dataset dir.")
    head: HeadSpec
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    batch_size: int = Field(8, ge=1, le=4096)
    steps: int | None = Field(None, ge=1, description="Optimizer steps (or use epochs).")
    epochs: int | None = Field(None, ge=1, description="Passes over the train split.")
    val_fraction: float = Field(0.0, ge=0, lt=1)
    seed: int = 0
    num_views: int = Field(1, ge=1, le=3)
    token_budget: int = Field(48, ge=8, le=4096, description="Text+image tokens per sample.")
    #: Commit a checkpoint (policy version) every this many steps (the last step always).
    checkpoint_every: int = Field(10, ge=1)
    priority: int = Field(1, ge=1, le=16, description="Fair-share weight on the trainer.")

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> SFTJobSpec:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of 'steps' or 'epochs'")
        return self


JobSpec = SFTJobSpec
_SPEC_KINDS: dict[str, type[BaseModel]] = {"sft": SFTJobSpec}


def format_validation_error(error: ValidationError) -> str:
    """``field.path: message`` lines, one per problem."""
    lines = []
    for item in error.errors():
        path = ".".join(str(p) for p in item["loc"]) or "<spec>"
        msg = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"{path}: {msg}")
    return "; ".join(lines)


def parse_job_spec(document: Any) -> JobSpec:
    """Validate a spec given as a mapping, JSON text or bytes; raise :class:`JobSpecError`."""
    if isinstance(document, bytes | str):
        try:
            document = json.loads(document)
        except json.JSONDecodeError as exc:
            raise JobSpecError(f"spec is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise JobSpecError(f"spec must be a mapping, got {type(document).__name__}")
    kind = document.get("kind")
    model = _SPEC_KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise JobSpecError(
            f"kind: unknown job kind {kind!r}; expected one of {sorted(_SPEC_KINDS)}"
        )
    try:
        return model.model_validate(document)  # type: ignore[return-value]
    except ValidationError as exc:
        raise JobSpecError(format_validation_error(exc)) from exc
