"""``joynexus bench learn``: does a policy trained through the service succeed at the task?

1. Record ``--demos`` successful demonstrations of the env's scripted expert (locally).
2. Start a stack (master, env workers, inferencer, trainer with a feature cache) serving
   ``--backbone``, push the demos to a tenant, and run two SFT jobs side by side on them: the
   policy (camera image + the robot's own proprio) and its **blind baseline** (the same head
   with ``vision: false``: proprio only).
3. Evaluate both closed-loop through the service on ``--eval-episodes`` held-out seeds.
4. RL (PPO from the SFT policy) for ``--rl-iterations``, then evaluate that policy the same way.

``--proprio-extras`` appends task extras (e.g. ``cube_pose``) to the proprio of both policies,
in recording, training and evaluation: with the object's pose, the "blind" policy is a state
policy, the ceiling that imitation of these demos reaches when nothing has to be seen.

Everything goes through the bus as a tenant would use it; the report is a table and, with
``--json``, ``{"env", "backbone", "demos", "success_rate", "blind_success_rate",
"rl_success_rate", "eval_episodes", "wall_s", ...}``.
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
from clients.sdk import Client, Job
from services.envs.datasets import record
from services.launcher import LocalStack, backbone_of

TENANT = "bench-learn"
#: Held-out evaluation seeds start here (demonstrations use seeds from ``--seed``).
EVAL_SEED = 1_000_000


def head(args: argparse.Namespace, vision: bool) -> dict[str, Any]:
    return {
        "kind": args.head,
        "chunk_len": args.chunk_len,
        "hidden_dim": args.hidden_dim,
        "num_layers": 2,
        "value_head": True,  # PPO continues from this policy
        "vision": vision,
    }


def env_kwargs(args: argparse.Namespace) -> dict[str, str]:
    """The env's constructor arguments for training and evaluation (not the image size: jobs
    carry it in their own field)."""
    return {"proprio_extras": args.proprio_extras} if args.proprio_extras else {}


async def evaluate(client: Client, args: argparse.Namespace, backbone: str, job: Job) -> float:
    ev = await client.evaluate(
        {
            "kind": "eval",
            "tenant": TENANT,
            "backbone": backbone,
            "policy_job": job.job_id,
            "env": args.env,
            "env_kwargs": env_kwargs(args),
            "episodes": args.eval_episodes,
            "max_episode_steps": args.max_episode_steps,
            "image_size": args.image_size,
            "parallel_envs": max(1, args.eval_episodes // (2 * args.env_workers)),
            "seed": EVAL_SEED,
        }
    )
    result = await ev.wait(3600)
    return float(result.metrics["success_rate"])


async def run(info: StackInfo, args: argparse.Namespace, demos: Path, backbone: str) -> dict:
    timings: dict[str, float] = {}
    async with await Client.connect(
        info.url, creds=info.creds(OPERATOR_NAME), user=info.user, password=info.password
    ) as client:
        await client.push_dataset(TENANT, demos, "demos")
        t0 = time.perf_counter()
        sft = {
            vision: await client.train_sft(
                {
                    "kind": "sft",
                    "tenant": TENANT,
                    "backbone": backbone,
                    "dataset": "demos",
                    "head": head(args, vision),
                    "steps": args.steps,
                    "batch_size": args.batch_size,
                    "token_budget": 16,
                    "checkpoint_every": max(10, args.steps // 10),
                    "optimizer": {
                        "lr": args.lr,
                        "schedule": "cosine",
                        "warmup_steps": min(100, args.steps // 10),
                    },
                    "seed": args.seed,
                }
            )
            for vision in (True, False)
        }
        for job in sft.values():
            await job.wait(7200)
        timings["sft_s"] = time.perf_counter() - t0
        print(
            f"SFT ({args.steps} steps, policy and blind baseline together): "
            f"{timings['sft_s']:.0f} s",
            flush=True,
        )
        t0 = time.perf_counter()
        seeing, blind = await asyncio.gather(
            evaluate(client, args, backbone, sft[True]),
            evaluate(client, args, backbone, sft[False]),
        )
        timings["eval_s"] = time.perf_counter() - t0
        print(f"success {seeing:.2f}, blind {blind:.2f} ({timings['eval_s']:.0f} s)", flush=True)
        rl_success = None
        if args.rl_iterations:
            t0 = time.perf_counter()
            rl = await client.train_rl(
                {
                    "kind": "rl",
                    "tenant": TENANT,
                    "backbone": backbone,
                    "env": args.env,
                    "env_kwargs": env_kwargs(args),
                    "head": head(args, True),
                    "init_from": sft[True].job_id,
                    "iterations": args.rl_iterations,
                    "episodes_per_iteration": args.rl_episodes,
                    "parallel_envs": max(1, args.rl_episodes // args.env_workers),
                    "max_episode_steps": args.max_episode_steps,
                    "image_size": args.image_size,
                    "optimizer": {"lr": args.rl_lr},
                    "seed": args.seed,
                }
            )
            await rl.wait(7200)
            rl_success = await evaluate(client, args, backbone, rl)
            timings["rl_s"] = time.perf_counter() - t0
            print(f"after RL: success {rl_success:.2f} ({timings['rl_s']:.0f} s)", flush=True)
    return {
        "success_rate": seeing,
        "blind_success_rate": blind,
        "rl_success_rate": rl_success,
        **timings,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="joynexus bench learn", description=__doc__)
    p.add_argument("--env", default="PushCube-v1")
    p.add_argument("--backbone", default="tiny", help="tiny name or checkpoint directory")
    p.add_argument("--demos", type=int, default=100, help="successful demonstrations")
    p.add_argument("--steps", type=int, default=2000, help="SFT optimizer steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--head", default="oft", choices=["oft", "discrete", "flow"])
    p.add_argument("--chunk-len", type=int, default=2, help="actions per policy call")
    p.add_argument("--hidden-dim", type=int, default=128)
    p.add_argument("--eval-episodes", type=int, default=50)
    p.add_argument("--max-episode-steps", type=int, default=50)
    p.add_argument("--rl-iterations", type=int, default=4, help="0: no RL")
    p.add_argument("--rl-episodes", type=int, default=16, help="episodes per RL iteration")
    p.add_argument("--rl-lr", type=float, default=1e-4)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--env-workers", type=int, default=2)
    p.add_argument("--feature-cache-mb", type=float, default=512.0)
    p.add_argument(
        "--proprio-extras",
        default="",
        help="task extras appended to both policies' proprio, comma-separated (`env describe`)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    started = time.perf_counter()
    served = backbone_of(args.backbone)
    with tempfile.TemporaryDirectory(prefix="joynexus-bench-learn-") as tmp:
        demos = Path(tmp) / "demos"
        info_ds = record(
            args.env,
            args.demos,
            demos,
            seed=args.seed,
            max_steps=args.max_episode_steps,
            env_kwargs={"image_size": args.image_size, **env_kwargs(args)},
            only_success=True,
        )
        print(
            f"{args.env}: {info_ds.total_episodes} demos, {info_ds.total_frames} frames", flush=True
        )
        stack = LocalStack(
            Path(tmp) / "home",
            tenants=(),
            roles={"master": 1, "envs": args.env_workers, "inferencer": 1, "trainer": 1},
            role_args={"trainer": ["--feature-cache-mb", str(args.feature_cache_mb)]},
            backbones=[served],
        )
        try:
            info = stack.start(300)
            measured = asyncio.run(run(info, args, demos, served.backbone_id))
        finally:
            stack.stop()
    result = {
        "env": args.env,
        "backbone": args.backbone,
        "demos": args.demos,
        "demo_frames": info_ds.total_frames,
        "proprio_extras": args.proprio_extras,
        "sft_steps": args.steps,
        "eval_episodes": args.eval_episodes,
        **measured,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(f"{'policy':<28} {'success':>8}")
    print(f"{'image + proprio (SFT)':<28} {result['success_rate']:>8.2f}")
    blind = "blind: proprio only (SFT)"
    if args.proprio_extras:
        print(f"proprio + task extras {args.proprio_extras} in both policies")
        blind = "blind: proprio + extras"
    print(f"{blind:<28} {result['blind_success_rate']:>8.2f}")
    if result["rl_success_rate"] is not None:
        print(f"{'image + proprio (SFT + RL)':<28} {result['rl_success_rate']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
