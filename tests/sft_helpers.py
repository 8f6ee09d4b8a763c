"""Shared pieces of the SFT end-to-end tests: datasets, specs, the stack, reading results."""

from __future__ import annotations

import io
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch
from nats.js import JetStreamContext

from bus.datasets import register_path
from bus.records import get_policy
from clients.sdk import Client, Job
from schemas import subjects
from schemas.events import PolicyPublished, Progress
from schemas.train import PolicyRecord
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID, REACH_GRASP_ID
from tests.conftest import Procs
from tests.helpers import start_service


def record_datasets(root: Path) -> dict[str, Path]:
    """A 2-D-action and a 3-D-action dataset of scripted demonstrations."""
    paths = {"reach": root / "reach", "grasp": root / "grasp"}
    record(REACH2D_ID, 16, paths["reach"], seed=0)
    record(REACH_GRASP_ID, 16, paths["grasp"], seed=100)
    return paths


async def registered(
    js: JetStreamContext, tenant: str, path: Path, dataset_id: str | None = None
) -> str:
    """Put the dataset directory ``path`` into ``tenant``'s namespace, as an operator does
    (:func:`bus.datasets.register_path`); return the id a spec names it by (default: the
    directory's name)."""
    dataset_id = dataset_id or re.sub(r"[^a-z0-9-]", "-", path.name.lower()).strip("-")
    await register_path(js, tenant, dataset_id, path)
    return dataset_id


def sft_spec(
    tenant: str, dataset: str, head: dict[str, object], steps: int, **kw: object
) -> dict[str, object]:
    """An SFT spec on ``dataset``, an id in ``tenant``'s namespace (see :func:`registered`)."""
    spec: dict[str, object] = {
        "kind": "sft",
        "tenant": tenant,
        "dataset": dataset,
        "head": head,
        "steps": steps,
        "batch_size": 8,
        "seed": 7,
        "checkpoint_every": 5,
        "optimizer": {"lr": 3e-3},
    }
    spec.update(kw)
    return spec


OFT_2D = {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}
DISCRETE_3D = {"kind": "discrete", "action_dim": 3, "chunk_len": 1, "proprio_dim": 4}
FLOW_2D = {"kind": "flow", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}


def start_stack(
    url: str, logs: Path, procs: Procs, *trainer_args: str
) -> dict[str, subprocess.Popen[bytes]]:
    logs.mkdir(parents=True, exist_ok=True)
    return {
        "master": procs.add(start_service("master", url, logs / "master.log")),
        "envs": procs.add(start_service("envs", url, logs / "envs.log")),
        "trainer": procs.add(
            start_service("trainer", url, logs / "trainer.log", "--deterministic", *trainer_args)
        ),
    }


@dataclass
class Trace:
    """What a job reported: per-step losses and the policy versions it published."""

    losses: dict[int, float] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)


async def follow(job: Job, timeout: float = 300.0) -> Trace:
    trace = Trace()
    async for ev in job.events(idle_timeout=timeout):
        if isinstance(ev, Progress):
            trace.losses[ev.step] = ev.metrics["loss"]
        elif isinstance(ev, PolicyPublished):
            trace.versions.append(ev.version)
    return trace


async def final_policy(
    js: JetStreamContext, tenant: str, job_id: str
) -> tuple[PolicyRecord, dict[str, torch.Tensor]]:
    """The job's committed policy record and its module's parameters."""
    rec, _ = await get_policy(await js.key_value(subjects.KV_POLICIES), tenant, job_id)
    assert rec is not None
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    buf = io.BytesIO()
    await store.get(rec.object_name, writeinto=buf)
    from vla.slot import TenantSlot

    slot = TenantSlot.from_bytes(buf.getvalue())
    return rec, {k: v.clone() for k, v in slot.module.state_dict().items()}


async def stored_losses(job: Job) -> dict[int, float]:
    """The job's per-step losses, read again from its stored events, each step reported
    once (asserted)."""
    losses: dict[int, float] = {}
    steps: list[int] = []
    async for event in job.events(idle_timeout=30):
        if isinstance(event, Progress):
            losses[event.step] = event.metrics["loss"]
            steps.append(event.step)
    assert len(steps) == len(set(steps)), steps
    return losses


async def submit_all(client: Client, specs: list[dict[str, object]]) -> list[Job]:
    return [await client.train_sft(s) for s in specs]
