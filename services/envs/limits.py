"""What an env worker checks of a task before it runs it: the task's tenant is its subject's,
and what the task makes the worker allocate or loop over (episode length, sessions, episodes,
image size, views) and the dataset it streams (bytes on disk, frames, image side, episode
length) stay within the operator's :class:`~schemas.limits.InputLimits`.

ENV subjects (``nexus.env.<tenant>.<job>``) carry tasks the master plans; tenants have no
publish permission on ``nexus.env.>`` (the broker enforces it: only the service identity may
publish there). A task still names its tenant, and is refused unless it is the subject's, so
a task can never make a worker touch another tenant's datasets, policies or TRAIN subject.
Every failure is a :class:`~bus.errors.PoisonError` naming the field and the limit.
"""

from __future__ import annotations

from bus.errors import PoisonError
from schemas import subjects
from schemas.env import EnvTask, EvalTask, RolloutTask, StreamDataset
from schemas.envctl import PrewarmEnv
from schemas.limits import InputLimits, exceeds
from vla.data import DatasetMeta
from vla.data.limits import dataset_violation


def check_task(subject: str, task: EnvTask, limits: InputLimits) -> None:
    """The task's tenant and job are its subject's, and its sizes are within ``limits``."""
    try:
        tenant, job_id = subjects.parse_env(subject)
    except subjects.SubjectError as exc:
        raise PoisonError(f"not an env task subject: {exc}") from exc
    if (task.tenant, task.job_id) != (tenant, job_id):
        raise PoisonError(
            f"task for {task.tenant!r}/{task.job_id!r} on the subject of {tenant!r}/{job_id!r}"
        )
    match task:
        case RolloutTask() | EvalTask():
            _at_most(
                "max_episode_steps",
                task.max_episode_steps,
                "max_episode_steps",
                limits.max_episode_steps,
            )
            _at_most(
                "parallel_envs", task.parallel_envs, "max_parallel_envs", limits.max_parallel_envs
            )
            _at_most("episodes", task.episodes, "max_episodes", limits.max_episodes)
            _at_most("image_size", task.image_size, "max_image_side", limits.max_image_side)
            _at_most("num_views", task.num_views, "max_views", limits.max_views)
            _at_most("proprio_dim", task.proprio_dim, "max_proprio_dim", limits.max_proprio_dim)
        case StreamDataset():
            _at_most("batch_size", task.batch_size, "max_batch_size", limits.max_batch_size)
            _at_most("chunk_len", task.chunk_len, "max_chunk_len", limits.max_chunk_len)
            _at_most("num_views", task.num_views, "max_views", limits.max_views)
            _at_most("proprio_dim", task.proprio_dim, "max_proprio_dim", limits.max_proprio_dim)
            _at_most("total_steps", task.total_steps, "max_steps", limits.max_steps)


def _at_most(field: str, value: int, limit: str, bound: int) -> None:
    if value < 0:
        raise PoisonError(f"{field}: {value} is negative")
    if value > bound:
        raise PoisonError(exceeds(field, value, limit, bound))


def check_dataset(name: str, meta: DatasetMeta, limits: InputLimits) -> None:
    """A dataset within the size, frame, image-side and episode-length limits (read from its
    metadata: call it before loading the frames)."""
    violation = dataset_violation(name, meta, limits)
    if violation:
        raise PoisonError(violation)


#: Most sessions of one kind a prewarm may ask a worker to hold.
MAX_PREWARM_SESSIONS = 64


def prewarm_refusal(request: PrewarmEnv, limits: InputLimits) -> str:
    """Why a prewarm is not even tried ('' if it may be)."""
    if not 1 <= request.sessions <= MAX_PREWARM_SESSIONS:
        return f"sessions: {request.sessions} is not within 1..{MAX_PREWARM_SESSIONS}"
    if not 8 <= request.image_size <= limits.max_image_side:
        return f"image_size: {request.image_size} is not within 8..{limits.max_image_side}"
    if not 1 <= request.max_episode_steps <= limits.max_episode_steps:
        return (
            f"max_episode_steps: {request.max_episode_steps} is not within "
            f"1..{limits.max_episode_steps}"
        )
    if not 1 <= len(request.env_id) <= 200:
        return "env_id: must be 1..200 characters"
    return ""
