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

from schemas.model import Observation
from schemas.tensor import TensorError, check_finite


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
    max_iteration_bytes: int = Field(
        2 << 30,
        ge=1024,
        description="Most bytes of one RL iteration's episodes (the trainer holds them all "
        "until the iteration's update).",
    )
    max_token_budget: int = Field(4096, ge=4, description="Most tokens per sample.")
    max_hidden_dim: int = Field(4096, ge=8, description="Widest head layer.")


def exceeds(field: str, value: object, limit: str, bound: object) -> str:
    """The one wording of a violated limit: ``obs.images[1]: 512x512 exceeds max_image_side
    256``."""
    return f"{field}: {value} exceeds {limit} {bound}"


def observation_violation(field: str, obs: Observation, limits: InputLimits) -> str | None:
    """What is wrong with ``obs`` whatever policy serves it (None: nothing): more views than
    ``max_views``, an instruction over ``max_instruction_chars``, an image that is not a
    non-empty uint8 (H, W, 3) within ``max_image_side``, a proprio that is not a finite
    float32 vector within ``max_proprio_dim``. ``field`` prefixes the message
    (``observations[3]``). The master checks this before relaying an act request and the
    inferencer before serving one (with the policy's own checks after it)."""
    if len(obs.images) > limits.max_views:
        return exceeds(f"{field}.images", f"{len(obs.images)} views", "max_views", limits.max_views)
    if not obs.images:
        return f"{field}.images: at least one view is needed"
    if len(obs.instruction) > limits.max_instruction_chars:
        chars = f"{len(obs.instruction)} chars"
        return exceeds(
            f"{field}.instruction", chars, "max_instruction_chars", limits.max_instruction_chars
        )
    try:
        for v, image in enumerate(obs.images):
            image.validate()
            if image.dtype != "uint8" or len(image.shape) != 3 or image.shape[2] != 3:
                return (
                    f"{field}.images[{v}]: expected uint8 (H, W, 3), "
                    f"got {image.dtype} {tuple(image.shape)}"
                )
            if image.shape[0] == 0 or image.shape[1] == 0:
                return f"{field}.images[{v}]: empty image"
            if max(image.shape[:2]) > limits.max_image_side:
                side = f"{image.shape[0]}x{image.shape[1]}"
                return exceeds(
                    f"{field}.images[{v}]", side, "max_image_side", limits.max_image_side
                )
        obs.proprio.validate()
        if obs.proprio.dtype != "float32" or len(obs.proprio.shape) != 1:
            return (
                f"{field}.proprio: expected a float32 vector, "
                f"got {obs.proprio.dtype} {tuple(obs.proprio.shape)}"
            )
        if obs.proprio.shape[0] > limits.max_proprio_dim:
            return exceeds(
                f"{field}.proprio", obs.proprio.shape[0], "max_proprio_dim", limits.max_proprio_dim
            )
        check_finite(obs.proprio, f"{field}.proprio")
    except TensorError as exc:
        return f"{field}: {exc}" if not str(exc).startswith(field) else str(exc)
    return None
