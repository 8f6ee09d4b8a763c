"""``joynexus demo``: the local stack running a multi-tenant SFT demo.

Starts the embedded NATS server and every role, records two scripted-expert datasets if the
home has none, submits three tenants' SFT jobs at once (different heads and action
dimensions on one shared backbone), prints their progress as it arrives, and ends with a
table of what each tenant got. Everything stops at the end; the exit code is 0 only if every
job succeeded and every role stayed healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

from clients.sdk import Client, Job, JobFailed
from schemas.events import PolicyPublished, Progress
from schemas.health import ROLES
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID, REACH_GRASP_ID
from services.launcher import LocalStack, wait_healthy

TENANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("acme-arm", "reach", {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}),
    ("beta-gripper", "grasp", {"kind": "discrete", "action_dim": 3, "proprio_dim": 4}),
    ("gamma-flow", "reach", {"kind": "flow", "action_dim": 2, "chunk_len": 4}),
]


def ensure_datasets(home: Path) -> dict[str, Path]:
    paths = {"reach": home / "datasets" / "reach2d", "grasp": home / "datasets" / "grasp2d"}
    if not (paths["reach"] / "meta" / "info.json").exists():
        record(REACH2D_ID, 40, paths["reach"], seed=0, overwrite=True)
    if not (paths["grasp"] / "meta" / "info.json").exists():
        record(REACH_GRASP_ID, 40, paths["grasp"], seed=1, overwrite=True)
    return paths


WINDOW = 10


async def follow(job: Job, losses: dict[str, list[float]]) -> None:
    async for ev in job.events(idle_timeout=300):
        if isinstance(ev, Progress):
            losses.setdefault(job.tenant, []).append(ev.metrics["loss"])
            if ev.step % 20 == 0 or ev.step == ev.total_steps:
                print(
                    f"  {job.tenant:<13} step {ev.step:>4}/{ev.total_steps} "
                    f"loss {ev.metrics['loss']:.4f}",
                    flush=True,
                )
        elif isinstance(ev, PolicyPublished) and ev.final:
            print(f"  {job.tenant:<13} published final policy v{ev.version}", flush=True)


async def run_demo(stack: LocalStack, data: dict[str, Path], steps: int) -> bool:
    info = stack.info
    assert info is not None
    seen, missing = await wait_healthy(info, list(ROLES), 120)
    for role in ROLES:
        print(f"  {role:<11} {'healthy ' + seen[role] if role in seen else 'MISSING'}")
    if missing:
        return False
    async with contextlib.AsyncExitStack() as clients:
        stamp = time.strftime("%H%M%S")
        jobs = []
        for tenant, dataset, head in TENANTS:
            # Each tenant connects as itself (its own creds file; `joynexus up` made them).
            client = await clients.enter_async_context(
                await Client.connect(
                    info.url, creds=info.creds(tenant), user=info.user, password=info.password
                )
            )
            # Each tenant pushes its dataset into its own namespace; the spec names its id.
            pushed = await client.push_dataset(tenant, data[dataset], dataset)
            print(
                f"{tenant}: dataset {dataset} pushed ({len(pushed.report.uploaded)} files "
                f"uploaded, {len(pushed.report.skipped)} already there)"
            )
            spec = {
                "kind": "sft",
                "tenant": tenant,
                "dataset": dataset,
                "head": head,
                "steps": steps,
                "batch_size": 4,
                "token_budget": 16,
                "seed": 0,
                "optimizer": {"lr": 3e-3},
            }
            jobs.append(await client.train_sft(spec, job_id=f"demo-{stamp}-{tenant}"))
            print(f"submitted {tenant}: {head['kind']} head, action_dim {head['action_dim']}")
        losses: dict[str, list[float]] = {}
        t0 = time.perf_counter()
        await asyncio.gather(*(follow(j, losses) for j in jobs))
        wall = time.perf_counter() - t0
        ok = True
        print(
            f"\n{'tenant':<14}{'head':<10}{'status':<11}{'loss, first 10':>15}"
            f"{'loss, last 10':>15}{'version':>9}"
        )
        for job, (_, _, head) in zip(jobs, TENANTS, strict=True):
            try:
                result = await job.wait(60)
                status, version = result.status, result.policy_version
            except JobFailed as exc:
                status, version, ok = exc.result.status, 0, False
            seq = losses.get(job.tenant, [float("nan")])
            first, final = mean(seq[:WINDOW]), mean(seq[-WINDOW:])
            print(
                f"{job.tenant:<14}{head['kind']:<10}{status:<11}{first:>15.4f}{final:>15.4f}"
                f"{version:>9}"
            )
        samples = len(jobs) * steps * 4
        print(
            f"\n{len(jobs)} tenants x {steps} steps on one shared backbone in {wall:.1f}s "
            f"({samples / wall:.0f} samples/s)"
        )
        _, missing = await wait_healthy(info, list(ROLES), 10)
        return ok and not missing


def main(home: Path, steps: int = 60) -> int:
    home.mkdir(parents=True, exist_ok=True)
    print(f"JoyNexus demo (home {home})")
    data = ensure_datasets(home)
    # every demo tenant gets its own identity (and creds file) at start
    stack = LocalStack(home, tenants=tuple(t for t, _, _ in TENANTS))
    try:
        info = stack.start_server()
        print(f"bus: {info.url}")
        stack.start_roles()
        ok = asyncio.run(run_demo(stack, data, steps))
    finally:
        stack.stop()
    print("demo " + ("succeeded" if ok else "FAILED"), file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
