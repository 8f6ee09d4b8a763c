"""A dataset against the operator's :class:`~schemas.limits.InputLimits`, from its metadata
alone (nothing is decoded): bytes on disk, frames, image side, longest episode. The master
checks it at submit and the env workers before they load a dataset, so a dataset past the
limits is refused before anything reads its frames."""

from __future__ import annotations

from pathlib import Path

from schemas.limits import InputLimits, exceeds
from vla.data.meta import DatasetMeta


def dataset_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (symlinks not followed)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def dataset_violation(name: str, meta: DatasetMeta, limits: InputLimits) -> str:
    """Why the dataset ``name`` is past ``limits`` ('' if it is not), naming the limit."""
    label = f"dataset {name!r}"
    size = dataset_bytes(meta.root)
    if size > limits.max_dataset_bytes:
        return exceeds(label, f"{size} bytes", "max_dataset_bytes", limits.max_dataset_bytes)
    if meta.num_frames > limits.max_dataset_frames:
        frames = f"{meta.num_frames} frames"
        return exceeds(label, frames, "max_dataset_frames", limits.max_dataset_frames)
    for key in meta.camera_keys:
        height, width = meta.info.features[key].shape[:2]
        if max(height, width) > limits.max_image_side:
            side = f"{height}x{width}"
            return exceeds(f"{label} {key}", side, "max_image_side", limits.max_image_side)
    longest = max((ep.length for ep in meta.episodes), default=0)
    if longest > limits.max_episode_steps:
        episode = f"an episode of {longest} frames"
        return exceeds(label, episode, "max_episode_steps", limits.max_episode_steps)
    return ""
