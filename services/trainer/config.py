"""The trainer's typed config (flags ``--prefetch 4`` or env ``JOYNEXUS_PREFETCH=4``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from bus.config import HeadsConfig
from schemas.limits import InputLimits


class TrainerConfig(HeadsConfig):
    """Trainer settings."""

    deterministic: bool = Field(False, description="torch deterministic algorithms.")
    memory_budget_mb: float = Field(1024.0, gt=0, description="Resident slot budget.")
    prefetch: int = Field(4, ge=1, description="Messages fetched ahead per tenant.")
    max_buffered: int = Field(
        256,
        ge=2,
        description="Most messages buffered per tenant, those waiting for an earlier step "
        "included (past it the latest waiting ones are handed back for later).",
    )
    max_buffered_mb: float = Field(
        256.0,
        gt=0,
        description="Most bytes (MiB) of messages buffered per tenant, payloads by reference "
        "counted at their size: at it nothing more is fetched for the tenant (the fetch that "
        "reaches it may pass it by up to --prefetch messages), and a buffer of waiting "
        "messages hands the latest back as at --max-buffered.",
    )
    quantum: int = Field(
        1,
        ge=1,
        description="DRR credit per round, in samples per unit of priority; rounds that would "
        "serve nobody run at once, so a small quantum costs nothing and keeps shares exact.",
    )
    commit_every_s: float = Field(10.0, gt=0, description="Commit at least this often.")
    keep_versions: int = Field(3, ge=1, description="Checkpoints kept per job.")
    ack_wait_s: float = Field(
        5.0, gt=1, description="Consumer ack wait; held messages get in-progress acks."
    )
    max_deliver: int = Field(10, ge=1, description="Deliveries before dead-lettering.")
    discover_every_s: float = Field(0.5, gt=0, description="New-tenant discovery period.")
    feature_cache_mb: float = Field(
        0.0,
        ge=0,
        description="Per-sample backbone features kept for reuse (0: off; see vla.featurecache).",
    )
    feature_store_mb: float = Field(
        0.0,
        ge=0,
        description="The feature cache's second tier: the backbone's object-store bucket, "
        "shared by its trainers and kept across restarts, under this budget (0: off; needs "
        "--feature-cache-mb).",
    )
    limit: InputLimits = Field(
        default_factory=InputLimits, description="Input bounds (--limit-*, JOYNEXUS_LIMIT_*)."
    )
    crash_after_commits: int = Field(
        0, ge=0, description="Fault injection: SIGKILL self after this many commits, before acking."
    )

    @model_validator(mode="after")
    def _buffer_past_prefetch(self) -> TrainerConfig:
        if self.max_buffered <= self.prefetch:
            raise ValueError(
                f"max_buffered ({self.max_buffered}) must exceed prefetch ({self.prefetch})"
            )
        return self

    @model_validator(mode="after")
    def _store_behind_a_cache(self) -> TrainerConfig:
        if self.feature_store_mb > 0 and self.feature_cache_mb <= 0:
            raise ValueError(
                "feature_store_mb: the feature cache's second tier needs its first: set "
                "--feature-cache-mb too"
            )
        return self
