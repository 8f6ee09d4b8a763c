"""What the trainer checks of every training message before it is buffered, job or no job.

Dtype, shape and finiteness of every tensor of an :class:`~schemas.train.SFTBatch` or a
:class:`~schemas.train.RolloutBatch`, their agreement with each other, and the operator's
:class:`~schemas.limits.InputLimits` (batch size, views, image side, proprio and action dims,
chunk length, episode length, instruction length). The checks that need the job's head (its
action dim, chunk length, proprio dim) are made when the message meets its job
(:func:`check_rollout_fits`, and :func:`services.trainer.sft.build_request` for SFT).

Each failure is a :class:`~bus.errors.PoisonError` whose message names the field and the
bound, e.g. ``rewards: 1 of 12 values are NaN or infinite`` or ``actions: chunk length 80
exceeds max_chunk_len 64``: the runtime dead-letters the message and the tenant's job hears
why (:meth:`services.trainer.announce.Announcer.tell_tenant`).
"""

from __future__ import annotations

import math

from bus.errors import PoisonError
from schemas.limits import InputLimits, exceeds
from schemas.tensor import Tensor, TensorError, check_finite, check_tensor
from schemas.train import ForwardBackward, OpenSlot, RolloutBatch, SFTBatch


def _tensor(
    tensor: Tensor, field: str, dtype: str, ndim: int, finite: bool = True
) -> tuple[int, ...]:
    try:
        return check_tensor(tensor, field, dtype, ndim, finite=finite)
    except TensorError as exc:
        raise PoisonError(str(exc)) from exc


def _at_most(field: str, what: str, value: int, limit: str, bound: int) -> None:
    if value > bound:
        raise PoisonError(exceeds(field, f"{what} {value}", limit, bound))


def _images(images: Tensor, limits: InputLimits) -> tuple[int, ...]:
    """uint8 (N, V, H, W, 3) within the view and side limits; returns its shape."""
    shape = _tensor(images, "images", "uint8", 5)
    n, views, height, width, channels = shape
    if n == 0 or views == 0 or height == 0 or width == 0 or channels != 3:
        raise PoisonError(
            f"images: expected uint8 (N, V, H, W, 3) with N, V, H, W > 0, got {shape}"
        )
    _at_most("images", "views", views, "max_views", limits.max_views)
    if max(height, width) > limits.max_image_side:
        raise PoisonError(
            exceeds("images", f"{height}x{width}", "max_image_side", limits.max_image_side)
        )
    return shape


def _instruction(text: str, field: str, limits: InputLimits) -> None:
    _at_most(field, "length", len(text), "max_instruction_chars", limits.max_instruction_chars)


def _vector_rows(
    tensor: Tensor, field: str, rows: int, limits: InputLimits, finite: bool = True
) -> int:
    """float32 (rows, P) with P within ``max_proprio_dim``; returns P."""
    shape = _tensor(tensor, field, "float32", 2, finite)
    if shape[0] != rows:
        raise PoisonError(f"{field}: {shape[0]} rows for {rows} images")
    _at_most(field, "dim", shape[1], "max_proprio_dim", limits.max_proprio_dim)
    return shape[1]


def _actions(
    tensor: Tensor, rows: int, limits: InputLimits, finite: bool = True
) -> tuple[int, int]:
    """float32 (rows, C, A) within the chunk and action-dim limits; returns (C, A)."""
    shape = _tensor(tensor, "actions", "float32", 3, finite)
    if shape[0] != rows:
        raise PoisonError(f"actions: {shape[0]} rows for {rows} images")
    _, chunk, dim = shape
    if chunk == 0 or dim == 0:
        raise PoisonError(f"actions: empty chunk or action vector {shape}")
    _at_most("actions", "chunk length", chunk, "max_chunk_len", limits.max_chunk_len)
    _at_most("actions", "action dim", dim, "max_action_dim", limits.max_action_dim)
    return chunk, dim


def _samples(
    batch: SFTBatch | ForwardBackward, limits: InputLimits, finite: bool
) -> tuple[int, int]:
    """A supervised batch's images, instructions, proprio and action targets well-formed,
    consistent and within ``limits``; returns (batch size, chunk length)."""
    n = _images(batch.images, limits)[0]
    _at_most("images", "batch size", n, "max_batch_size", limits.max_batch_size)
    if len(batch.instructions) != n:
        raise PoisonError(f"instructions: {len(batch.instructions)} for {n} images")
    for i, text in enumerate(batch.instructions):
        _instruction(text, f"instructions[{i}]", limits)
    _vector_rows(batch.proprio, "proprio", n, limits, finite=finite)
    chunk, _ = _actions(batch.actions, n, limits, finite=finite)
    return n, chunk


def check_sft(batch: SFTBatch, limits: InputLimits) -> None:
    """Every tensor of an SFT micro-batch well-formed, consistent and within ``limits``.
    Finiteness is not checked here (:func:`sft_non_finite`): a batch with NaN values is
    dropped by its job at its turn, like a step whose loss is not finite, and the job goes
    on; a malformed one can never be applied and fails the job."""
    if min(batch.step, batch.epoch, batch.batch_index) < 0:
        raise PoisonError(
            f"step/epoch/batch_index must be >= 0, got {batch.step}/{batch.epoch}/"
            f"{batch.batch_index}"
        )
    n, chunk = _samples(batch, limits, finite=False)
    pad = _tensor(batch.action_pad, "action_pad", "bool", 2)
    if pad != (n, chunk):
        raise PoisonError(f"action_pad: expected bool {(n, chunk)}, got {pad}")


def check_call(call: ForwardBackward, limits: InputLimits) -> None:
    """A session's forward(-backward): its tensors well-formed, finite, consistent and within
    ``limits`` (the SFT bounds). Checked when the call's turn comes, so that a bad one is
    answered and counted like any call (a dead letter alone would leave its number unused,
    and every later call of the session waiting for it)."""
    n, _ = _samples(call, limits, finite=True)
    for name in ("advantages", "old_log_probs"):
        value = getattr(call, name)
        if value is not None and _tensor(value, name, "float32", 1) != (n,):
            raise PoisonError(f"{name}: expected float32 ({n},), got {tuple(value.shape)}")
    if not 0.0 < call.clip <= 1.0:
        raise PoisonError(f"clip: {call.clip} is not in (0, 1]")


def sft_non_finite(batch: SFTBatch) -> str | None:
    """What of a (well-formed) SFT batch is NaN or infinite, or None."""
    for name in ("proprio", "actions"):
        try:
            check_finite(getattr(batch, name), name)
        except TensorError as exc:
            return str(exc)
    return None


def check_rollout(body: RolloutBatch, limits: InputLimits) -> None:
    """Every tensor of an RL episode well-formed, consistent, finite and within ``limits``."""
    if min(body.iteration, body.episode, body.policy_version) < 0:
        raise PoisonError(
            f"iteration/episode/policy_version must be >= 0, got {body.iteration}/"
            f"{body.episode}/{body.policy_version}"
        )
    steps = _images(body.images, limits)[0]
    _at_most("images", "episode length", steps, "max_episode_steps", limits.max_episode_steps)
    _instruction(body.instruction, "instruction", limits)
    _vector_rows(body.proprio, "proprio", steps, limits)
    _actions(body.actions, steps, limits)
    for name in ("log_probs", "values", "rewards"):
        shape = _tensor(getattr(body, name), name, "float32", 1)
        if shape != (steps,):
            raise PoisonError(f"{name}: expected float32 ({steps},), got {shape}")
    if not math.isfinite(body.bootstrap_value):
        raise PoisonError(f"bootstrap_value: {body.bootstrap_value} is not finite")


def check_open_slot(spec: OpenSlot, limits: InputLimits) -> None:
    """A slot the master opens is within the limits too (a defence in depth: tenants cannot
    publish on TRAIN subjects, but a service must not allocate past the operator's bounds)."""
    head = spec.head
    _at_most("head.action_dim", "value", head.action_dim, "max_action_dim", limits.max_action_dim)
    _at_most("head.chunk_len", "value", head.chunk_len, "max_chunk_len", limits.max_chunk_len)
    _at_most(
        "head.proprio_dim", "value", head.proprio_dim, "max_proprio_dim", limits.max_proprio_dim
    )
    _at_most("head.hidden_dim", "value", head.hidden_dim, "max_hidden_dim", limits.max_hidden_dim)
    _at_most("num_views", "value", spec.num_views, "max_views", limits.max_views)
    _at_most(
        "token_budget", "value", spec.token_budget, "max_token_budget", limits.max_token_budget
    )
    if spec.rl is not None:
        _at_most("total_steps", "value", spec.total_steps, "max_iterations", limits.max_iterations)
    else:
        _at_most("total_steps", "value", spec.total_steps, "max_steps", limits.max_steps)


def check_rollout_fits(body: RolloutBatch, spec: OpenSlot) -> None:
    """An episode's actions and proprio have the job's head's shape, and its index is one of
    the iteration's episodes."""
    head = spec.head
    chunk_dim = tuple(body.actions.shape[1:])
    if chunk_dim != (head.chunk_len, head.action_dim):
        raise PoisonError(
            f"actions: the job's head expects chunks of (chunk_len, action_dim) = "
            f"{(head.chunk_len, head.action_dim)}, got {chunk_dim}"
        )
    if body.proprio.shape[1] != head.proprio_dim:
        raise PoisonError(
            f"proprio: the job's head expects proprio_dim {head.proprio_dim}, "
            f"got {body.proprio.shape[1]}"
        )
    assert spec.rl is not None
    if body.episode >= spec.rl.episodes_per_iteration:
        raise PoisonError(
            f"episode: {body.episode} is not below the job's episodes_per_iteration "
            f"{spec.rl.episodes_per_iteration}"
        )
