"""``joynexus bench rl``: one RL job over the real bus for a longer budget; success rate and
mean return per iteration.

Runs the embedded NATS server, master, ``--env-workers`` env workers, one inferencer and one
trainer; the head's action and proprio dimensions are read off the env's adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bus.identity import OPERATOR_NAME
from bus.local import StackInfo
from clients.sdk import Client
from schemas.events import Progress
from services.envs.adapters import make_adapter
from services.launcher import LocalStack


def env_dims(env_id: str, image_size: int, env_kwargs: dict[str, Any]) -> tuple[int, int]:
    adapter = make_adapter(env_id, image_size=image_size, **env_kwargs)
    try:
        return adapter.action_dim, adapter.proprio_dim
    finally:
        adapter.close()


async def run_job(info: StackInfo, spec: dict[str, Any]) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = []
    # the operator acts for the bench's tenant (no TenantRecord: the master takes any)
    async with await Client.connect(
        info.url, creds=info.creds(OPERATOR_NAME), user=info.user, password=info.password
    ) as client:
        job = await client.train_rl(spec)
        t0 = time.perf_counter()
        async for ev in job.events(idle_timeout=1800):
            if isinstance(ev, Progress):
                row = {
                    "iteration": ev.step,
                    "success_rate": ev.metrics.get("success_rate", 0.0),
                    "mean_return": ev.metrics.get("return_mean", 0.0),
                    "episode_length": ev.metrics.get("episode_length", 0.0),
                    "wall_s": time.perf_counter() - t0,
                }
                rows.append(row)
                print(
                    f"{ev.step:>9} {row['success_rate']:>12.2f} {row['mean_return']:>12.3f} "
                    f"{row['episode_length']:>10.1f} {row['wall_s']:>8.1f}",
                    flush=True,
                )
        await job.wait(60)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="joynexus bench rl", description=__doc__)
    p.add_argument("--env", default="PushCube-v1")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--episodes", type=int, default=8, help="episodes per iteration")
    p.add_argument("--max-episode-steps", type=int, default=50)
    p.add_argument("--head", default="oft", choices=["oft", "discrete", "flow"])
    p.add_argument("--algorithm", default="ppo", choices=["ppo", "grpo"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--env-workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env-kwargs", default="{}", help="JSON of the env's constructor args")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--token-budget", type=int, default=16)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    env_kwargs = json.loads(args.env_kwargs)
    action_dim, proprio_dim = env_dims(args.env, args.image_size, env_kwargs)
    spec = {
        "kind": "rl",
        "tenant": "bench-rl",
        "env": args.env,
        "env_kwargs": env_kwargs,
        "token_budget": args.token_budget,
        "head": {
            "kind": args.head,
            "action_dim": action_dim,
            "proprio_dim": proprio_dim,
            "value_head": args.algorithm == "ppo",
        },
        "iterations": args.iterations,
        "episodes_per_iteration": args.episodes,
        "parallel_envs": max(1, args.episodes // args.env_workers),
        "max_episode_steps": args.max_episode_steps,
        "image_size": args.image_size,
        "seed": args.seed,
        "optimizer": {"lr": args.lr},
        "rl": {"algorithm": args.algorithm, "epochs": args.epochs, "minibatch_size": 64},
    }
    print(
        f"{args.env}: action_dim {action_dim}, proprio_dim {proprio_dim}, "
        f"{args.iterations} iterations x {args.episodes} episodes"
    )
    print(f"{'iteration':>9} {'success_rate':>12} {'mean_return':>12} {'ep_len':>10} {'wall s':>8}")
    with tempfile.TemporaryDirectory(prefix="joynexus-bench-rl-") as tmp:
        stack = LocalStack(
            Path(tmp),
            tenants=(),
            roles={"master": 1, "envs": args.env_workers, "inferencer": 1, "trainer": 1},
        )
        try:
            info = stack.start(180)
            rows = asyncio.run(run_job(info, spec))
        finally:
            stack.stop()
    result = {
        "env": args.env,
        "algorithm": args.algorithm,
        "head": args.head,
        "episodes_per_iteration": args.episodes,
        "iterations": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
