"""Operator-set bounds on every input a tenant can send (DESIGN.md §5).

Each role's config carries one :class:`InputLimits` in its ``limit`` field, set from flags
``--limit-max-image-side 256`` or environment variables ``JOYNEXUS_LIMIT_MAX_IMAGE_SIDE=256``
(:mod:`bus.config` flattens it), so one variable in the stack's environment bounds every
role alike. The roles check them where input enters: the master at submit (spec bounds,
command size), the inferencer's admission (images, views, proprio), the trainer's intake
(every tensor of a batch or rollout), the env workers (dataset size, episode length).

A violation is reported by :func:`exceeds` as ``"<field>: <value> exceeds <limit> <bound>"``,
so the tenant reads which of its fields broke which limit.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class InputLimits(BaseModel):
    """Bounds on tenant input. Defaults are generous for real VLA work (a 0.5-4B backbone
    at 224-512 px, chunks of tens of actions) and small enough that one tenant cannot make a
    service allocate without bound."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- messages --------------------------------------------------------------------------
    max_message_bytes: int = Field(
        8 << 20, ge=1024, description="Largest message a role accepts from a tenant's work."
    )
    max_spec_bytes: int = Field(64 << 10, ge=256, description="Largest job spec (JSON bytes).")
    max_instruction_chars: int = Field(1024, ge=1, description="Longest task instruction.")
    # -- observations and actions -----------------------------------------------------------
    max_image_side: int = Field(512, ge=8, description="Largest image height or width (px).")
    max_views: int = Field(3, ge=1, description="Most camera views per observation.")
    max_observations: int = Field(256, ge=1, description="Most observations per act request.")
    max_proprio_dim: int = Field(256, ge=0, description="Largest proprio state vector.")
    max_action_dim: int = Field(64, ge=1, description="Largest action vector.")
    max_chunk_len: int = Field(64, ge=1, description="Most actions per chunk.")
    max_episode_steps: int = Field(10_000, ge=1, description="Longest episode (transitions).")
    max_batch_size: int = Field(4096, ge=1, description="Largest SFT micro-batch.")
    # -- datasets ---------------------------------------------------------------------------
    max_dataset_bytes: int = Field(16 << 30, ge=1, description="Largest dataset on disk.")
    max_dataset_frames: int = Field(10_000_000, ge=1, description="Most frames in a dataset.")
    # -- spec bounds ------------------------------------------------------------------------
    max_steps: int = Field(1_000_000, ge=1, description="Most optimizer steps of an SFT job.")
    max_iterations: int = Field(100_000, ge=1, description="Most iterations of an RL job.")
    max_episodes: int = Field(
        100_000, ge=1, description="Most episodes per RL iteration or evaluation."
    )
    max_parallel_envs: int = Field(256, ge=1, description="Most env sessions per task.")
    max_token_budget: int = Field(4096, ge=4, description="Most tokens per sample.")
    max_hidden_dim: int = Field(4096, ge=8, description="Widest head layer.")


def exceeds(field: str, value: object, limit: str, bound: object) -> str:
    """The one wording of a violated limit: ``obs.images[1]: 512x512 exceeds max_image_side
    256``."""
    return f"{field}: {value} exceeds {limit} {bound}"
