"""``joynexus data inspect``: a validated dataset summarised for people."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from vla.data.dataset import load_dataset
from vla.data.layout import FeatureSpec


@dataclass(frozen=True)
class TaskSummary:
    task_index: int
    task: str
    episodes: int


@dataclass(frozen=True)
class DatasetSummary:
    """What :func:`inspect` reports; :meth:`format` renders it for people."""

    root: str
    codebase_version: str
    fps: int
    total_episodes: int
    total_frames: int
    features: dict[str, FeatureSpec]
    camera_keys: list[str]
    tasks: list[TaskSummary]
    episode_length_min: int
    episode_length_mean: float
    episode_length_max: int
    action_min: list[float]
    action_max: list[float]
    action_mean: list[float]
    #: Fraction of episodes marked successful, over those with a recorded outcome.
    success_rate: float | None
    env_id: str | None = None

    def format(self) -> str:
        """A human-readable multi-line report."""

        def vec(values: list[float]) -> str:
            return "[" + ", ".join(f"{v:+.3f}" for v in values) + "]"

        lines = [
            f"dataset   {self.root}  ({self.codebase_version})",
            f"episodes  {self.total_episodes}   frames {self.total_frames}   fps {self.fps}"
            + (f"   env {self.env_id}" if self.env_id else ""),
            f"length    min {self.episode_length_min}  mean {self.episode_length_mean:.1f}"
            f"  max {self.episode_length_max}",
            "features",
        ]
        for name, spec in self.features.items():
            lines.append(f"  {name:<28} {spec.dtype:<8} {tuple(spec.shape)}")
        lines.append(f"tasks     {len(self.tasks)}")
        for task in self.tasks:
            lines.append(f"  [{task.task_index}] {task.task!r}  ({task.episodes} episodes)")
        lines.append(f"action    min {vec(self.action_min)}")
        lines.append(f"          max {vec(self.action_max)}")
        lines.append(f"          mean {vec(self.action_mean)}")
        rate = "not recorded" if self.success_rate is None else f"{self.success_rate:.1%}"
        lines.append(f"success   {rate}")
        return "\n".join(lines)


def inspect(root: str | os.PathLike[str]) -> DatasetSummary:
    """Validate the dataset at ``root`` and summarise it (see :meth:`DatasetSummary.format`)."""
    ds = load_dataset(root)
    lengths = np.array([ep.length for ep in ds.episodes])
    outcomes = [ep.success for ep in ds.episodes if ep.success is not None]
    task_of = {task: index for index, task in ds.tasks.items()}
    per_task = {index: 0 for index in ds.tasks}
    for ep in ds.episodes:
        per_task[task_of[ep.task]] += 1
    action_N_A = ds.action_N_A.reshape(len(ds), -1)
    return DatasetSummary(
        root=str(ds.root),
        codebase_version=ds.info.codebase_version,
        fps=ds.info.fps,
        total_episodes=ds.num_episodes,
        total_frames=len(ds),
        features=dict(ds.info.features),
        camera_keys=list(ds.camera_keys),
        tasks=[TaskSummary(i, ds.tasks[i], per_task[i]) for i in sorted(ds.tasks)],
        episode_length_min=int(lengths.min()),
        episode_length_mean=float(lengths.mean()),
        episode_length_max=int(lengths.max()),
        action_min=action_N_A.min(axis=0).tolist(),
        action_max=action_N_A.max(axis=0).tolist(),
        action_mean=action_N_A.mean(axis=0).tolist(),
        success_rate=float(np.mean(outcomes)) if outcomes else None,
        env_id=ds.info.env_id,
    )
