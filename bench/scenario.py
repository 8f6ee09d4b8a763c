"""The demo's scenario: the paper's mix of three RL tenants and one SFT tenant, at this
machine's scale.

Each RL tenant trains on a different ManiSkill task with a different head type and algorithm;
the SFT tenant clones a scripted expert on our Reach2D sim. The same specs (seeds included)
run in both of the demo's phases, so any difference between the phases is the sharing's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["rl", "sft"]


@dataclass(frozen=True)
class Budget:
    """How much work each tenant's job is."""

    rl_iterations: int
    rl_episodes: int
    rl_parallel_envs: int
    rl_episode_steps: int
    rl_epochs: int
    sft_steps: int
    sft_batch: int
    #: Episodes of the scripted expert recorded for the SFT tenant's dataset.
    sft_episodes: int


#: ``joynexus demo --quick``: under 2 minutes here, stack start and warm-up included.
QUICK = Budget(
    rl_iterations=3,
    rl_episodes=2,
    rl_parallel_envs=2,
    rl_episode_steps=16,
    rl_epochs=2,
    sft_steps=120,
    sft_batch=8,
    sft_episodes=24,
)
#: ``joynexus demo``: under 15 minutes here.
DEFAULT = Budget(
    rl_iterations=6,
    rl_episodes=8,
    rl_parallel_envs=4,
    rl_episode_steps=24,
    rl_epochs=3,
    sft_steps=400,
    sft_batch=8,
    sft_episodes=40,
)


@dataclass(frozen=True)
class DemoTenant:
    """One tenant of the scenario and what its job trains."""

    name: str
    kind: Kind
    #: ManiSkill task (RL) or the dataset id in the tenant's namespace (SFT).
    target: str
    head: dict[str, Any]
    algorithm: str = ""

    @property
    def label(self) -> str:
        what = f"{self.algorithm.upper()} on {self.target}" if self.kind == "rl" else "SFT"
        return f"{self.name} ({self.head['kind']} head, {what})"


TENANTS: tuple[DemoTenant, ...] = (
    DemoTenant("push-oft", "rl", "PushCube-v1", {"kind": "oft", "value_head": True}, "ppo"),
    DemoTenant("pull-discrete", "rl", "PullCube-v1", {"kind": "discrete", "num_bins": 16}, "grpo"),
    DemoTenant("pick-flow", "rl", "PickCube-v1", {"kind": "flow", "value_head": True}, "ppo"),
    DemoTenant(
        "reach-sft",
        "sft",
        "reach2d",
        {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4},
    ),
)

#: The SFT job's checkpoint interval (steps).
SFT_CHECKPOINT_EVERY = 20
#: Text tokens per sample: the same for every tenant, so all share one compatibility key.
TOKEN_BUDGET = 16
IMAGE_SIZE = 64


def job_spec(tenant: DemoTenant, budget: Budget, *, seed: int = 0) -> dict[str, Any]:
    """The job ``tenant`` submits (identical in both phases)."""
    if tenant.kind == "sft":
        return {
            "kind": "sft",
            "tenant": tenant.name,
            "dataset": tenant.target,
            "head": tenant.head,
            "steps": budget.sft_steps,
            "batch_size": budget.sft_batch,
            "token_budget": TOKEN_BUDGET,
            "checkpoint_every": SFT_CHECKPOINT_EVERY,
            "seed": seed,
            "optimizer": {"lr": 3e-3},
        }
    return {
        "kind": "rl",
        "tenant": tenant.name,
        "env": tenant.target,
        "head": tenant.head,  # action and proprio dims come from the env
        "iterations": budget.rl_iterations,
        "episodes_per_iteration": budget.rl_episodes,
        "parallel_envs": budget.rl_parallel_envs,
        "max_episode_steps": budget.rl_episode_steps,
        "image_size": IMAGE_SIZE,
        "token_budget": TOKEN_BUDGET,
        "seed": seed,
        "optimizer": {"lr": 3e-4},
        "rl": {"algorithm": tenant.algorithm, "epochs": budget.rl_epochs, "minibatch_size": 32},
    }


def warmup_spec(tenant: DemoTenant, budget: Budget, name: str) -> dict[str, Any]:
    """A short job of ``tenant``'s kind under the tenant ``name``: it builds the env
    sessions (as many as one of the tenant's rollout tasks holds) and touches every code
    path once, so neither phase pays first-use costs."""
    spec = job_spec(tenant, budget)
    spec["tenant"] = name
    if tenant.kind == "sft":
        spec["steps"] = 5
    else:  # the same episode limit: the sessions prewarmed are of that kind
        spec.update(iterations=1, episodes_per_iteration=budget.rl_parallel_envs)
    return spec


def units(tenant: DemoTenant, budget: Budget) -> int:
    """Progress units of the tenant's job (iterations or steps), for the progress line."""
    return budget.rl_iterations if tenant.kind == "rl" else budget.sft_steps


@dataclass
class DemoConfig:
    """What ``joynexus demo`` runs, from its flags."""

    home: Path
    quick: bool = False
    env_workers: int = 3
    json_path: Path | None = None
    report_path: Path | None = None
    costs_path: Path | None = None
    seed: int = 0

    @property
    def budget(self) -> Budget:
        return QUICK if self.quick else DEFAULT

    @property
    def out_dir(self) -> Path:
        return self.home / "demo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``joynexus demo``'s flags (here, away from the demo's imports, for the CLI's parser)."""
    p.add_argument("--quick", action="store_true", help="a smaller budget (under 5 minutes)")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--report", type=Path, help="the HTML report (default <home>/demo/)")
    p.add_argument("--costs", type=Path, help="where to write the costs the simulator reads")
    p.add_argument(
        "--env-workers",
        type=int,
        default=3,
        help="env worker processes (a worker steps one simulator at a time: one per RL tenant)",
    )
    p.add_argument("--seed", type=int, default=0, help="every job's seed")


def config_of(args: argparse.Namespace, home: Path) -> DemoConfig:
    """The config from :func:`bench.scenario.add_arguments`' flags."""
    if args.env_workers < 1:
        raise SystemExit("joynexus demo: --env-workers must be at least 1")
    return DemoConfig(
        home=home,
        quick=args.quick,
        env_workers=args.env_workers,
        json_path=args.json,
        report_path=args.report,
        costs_path=args.costs,
        seed=args.seed,
    )
