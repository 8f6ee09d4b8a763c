"""RL and evaluation end to end on a real stack: master, env worker, inferencer, trainer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from bus.datasets import register_path
from bus.records import get_policy
from bus.server import EmbeddedServer
from clients.sdk import Client, JobFailed
from schemas import subjects
from schemas.events import Progress
from schemas.train import PolicyRecord
from tests.conftest import Procs
from tests.helpers import start_service, uid

REACH_EASY: dict[str, Any] = {"num_distractors": 0, "max_speed": 0.2}
#: The easiest variant: the target's position is in the proprio state too, so learning does
#: not have to go through the (random, frozen) tiny backbone's image features.
REACH_STATE: dict[str, Any] = {**REACH_EASY, "target_in_state": True}


def start_rl_stack(url: str, logs: Path, procs: Procs, *trainer_args: str) -> None:
    logs.mkdir(parents=True, exist_ok=True)
    for role in ("master", "envs", "inferencer"):
        procs.add(start_service(role, url, logs / f"{role}.log"))
    procs.add(start_service("trainer", url, logs / "trainer.log", "--deterministic", *trainer_args))


def rl_spec(tenant: str, iterations: int, **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "kind": "rl",
        "tenant": tenant,
        "env": "JoyNexus/Reach2D-v0",
        "env_kwargs": REACH_EASY,
        "max_episode_steps": 20,
        "head": {"kind": "oft", "action_dim": 2, "proprio_dim": 4, "value_head": True},
        "iterations": iterations,
        "episodes_per_iteration": 8,
        "parallel_envs": 4,
        "token_budget": 8,
        "seed": 3,
        "optimizer": {"lr": 3e-3},
        "rl": {"epochs": 4, "minibatch_size": 32},
    }
    spec.update(kw)
    return spec


async def iterations_of(client: Client, tenant: str, job_id: str) -> list[Progress]:
    from clients.sdk import Job

    return [
        ev
        async for ev in Job(client, tenant, job_id).events(idle_timeout=300)
        if isinstance(ev, Progress)
    ]


async def policy_entry(
    js: JetStreamContext, tenant: str, job_id: str
) -> tuple[PolicyRecord | None, int]:
    return await get_policy(await js.key_value(subjects.KV_POLICIES), tenant, job_id)


@pytest.mark.timeout(400)
async def test_rl_loop_publishes_versions_and_evaluation_is_read_only(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    start_rl_stack(nats_server.url, tmp_path / "logs", procs)
    tenant = uid("rl")
    async with await Client.connect(nats_server.url) as client:
        job = await client.train_rl(rl_spec(tenant, iterations=3))
        progress = await iterations_of(client, tenant, job.job_id)
        result = await job.wait(60)
        assert result.status == "succeeded" and result.policy_version == 4  # initial + 3
        assert [p.step for p in progress] == [1, 2, 3]
        for p in progress:
            assert p.metrics["episodes"] == 8 and p.metrics["policy_lag_max"] == 0
            assert {"return_mean", "success_rate", "policy_loss", "approx_kl"} <= set(p.metrics)

        record, revision = await policy_entry(js, tenant, job.job_id)
        assert record is not None
        store = await js.object_store(subjects.OBJ_CHECKPOINTS)
        objects_before = sorted(i.name or "" for i in await store.list())
        evaluation = await client.evaluate(
            {
                "tenant": tenant,
                "policy_job": job.job_id,
                "env": "JoyNexus/Reach2D-v0",
                "env_kwargs": REACH_EASY,
                "max_episode_steps": 20,
                "episodes": 8,
            }
        )
        outcome = await evaluation.wait(120)
        assert outcome.metrics["episodes"] == 8
        assert 0.0 <= outcome.metrics["success_rate"] <= 1.0
        assert outcome.metrics["policy_version"] == 4
        assert await policy_entry(js, tenant, job.job_id) == (record, revision)
        assert sorted(i.name or "" for i in await store.list()) == objects_before


async def test_bad_rl_specs_are_rejected_with_the_reason(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    start_rl_stack(nats_server.url, tmp_path / "logs", procs)
    tenant = uid("rlbad")
    async with await Client.connect(nats_server.url) as client:
        unknown_env = await client.train_rl(rl_spec(tenant, 2, env="JoyNexus/Teleport-v9"))
        with pytest.raises(JobFailed, match="JoyNexus/Teleport-v9"):
            await unknown_env.wait(120)
        no_policy = await client.evaluate(
            {"tenant": tenant, "policy_job": "nothing-here", "env": "JoyNexus/Reach2D-v0"}
        )
        with pytest.raises(JobFailed, match="policy_job: job 'nothing-here'"):
            await no_policy.wait(60)
        # 1000 steps of 512 px: ~790 MB an episode, refused before any is run.
        huge = await client.train_rl(rl_spec(tenant, 2, max_episode_steps=1000, image_size=512))
        with pytest.raises(
            JobFailed,
            match=r"an episode of max_episode_steps 1000 x num_views 1 x image_size 512: up to "
            r"\d+ bytes exceeds max_message_bytes 8388608",
        ):
            await huge.wait(60)
        # 4096 episodes of ~620 KB: ~2.6 GB the trainer would hold until the update.
        many = await client.train_rl(
            rl_spec(tenant, 2, max_episode_steps=50, episodes_per_iteration=4096)
        )
        with pytest.raises(
            JobFailed,
            match=r"an iteration of episodes_per_iteration 4096 episodes of max_episode_steps "
            r"50 x num_views 1 x image_size 64: up to \d+ bytes exceeds max_iteration_bytes "
            r"2147483648",
        ):
            await many.wait(60)


def maniskill_rl_spec(tenant: str, env: str, head: dict[str, Any], **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "kind": "rl",
        "tenant": tenant,
        "env": env,
        "head": head,
        "iterations": 2,
        "episodes_per_iteration": 2,
        "parallel_envs": 2,
        "max_episode_steps": 12,
        "image_size": 64,
        "token_budget": 8,
        "seed": 0,
        "rl": {"epochs": 2, "minibatch_size": 16},
    }
    spec.update(kw)
    return spec


PUSH_CUBE_HEAD = {"kind": "oft", "action_dim": 4, "proprio_dim": 25, "value_head": True}


@pytest.mark.slow  # ManiSkill RL through the VLA runs in tests/test_demo.py (three tasks)
@pytest.mark.timeout(600)
async def test_rl_on_maniskill_pushcube_through_the_vla_then_evaluation(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """PushCube-v1 with proprio + a 64x64 RGB camera: rollouts, two updates, the inferencer
    serving each new version, then an evaluation of the final one."""
    start_rl_stack(nats_server.url, tmp_path / "logs", procs)
    tenant = uid("push")
    async with await Client.connect(nats_server.url) as client:
        job = await client.train_rl(maniskill_rl_spec(tenant, "PushCube-v1", PUSH_CUBE_HEAD))
        progress = await iterations_of(client, tenant, job.job_id)
        result = await job.wait(60)
        assert result.status == "succeeded" and result.policy_version == 3
        # Iteration i's rollouts were served by version i + 1: the inferencer picked up each
        # newly committed version (lag 0 is enforced by the trainer).
        assert [p.step for p in progress] == [1, 2]
        assert all(p.metrics["policy_lag_max"] == 0 for p in progress)
        evaluation = await client.evaluate(
            {
                "tenant": tenant,
                "policy_job": job.job_id,
                "env": "PushCube-v1",
                "max_episode_steps": 12,
                "episodes": 2,
                "parallel_envs": 2,
            }
        )
        outcome = await evaluation.wait(300)
        assert outcome.metrics["policy_version"] == 3 and outcome.metrics["episodes"] == 2


@pytest.mark.slow  # tests/test_demo.py runs three ManiSkill RL tenants and one SFT tenant shared
@pytest.mark.timeout(600)
async def test_two_maniskill_rl_tenants_and_one_sft_tenant_share_the_services(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """One trainer, one inferencer, two env workers; PushCube (oft head) and PullCube
    (discrete head) RL tenants beside a Reach2D SFT tenant: all three complete."""
    logs = tmp_path / "logs"
    start_rl_stack(nats_server.url, logs, procs)
    procs.add(start_service("envs", nats_server.url, logs / "envs-2.log"))
    from services.envs.datasets import record

    record("JoyNexus/Reach2D-v0", 8, tmp_path / "reach", seed=0)
    push, pull, sft = uid("push"), uid("pull"), uid("sft")
    async with await Client.connect(nats_server.url) as client:
        await register_path(client.js, sft, "reach", tmp_path / "reach")
        jobs = [
            await client.train_rl(maniskill_rl_spec(push, "PushCube-v1", PUSH_CUBE_HEAD)),
            await client.train_rl(
                maniskill_rl_spec(
                    pull,
                    "PullCube-v1",
                    {"kind": "discrete", "action_dim": 4, "proprio_dim": 28, "num_bins": 16},
                    rl={"algorithm": "grpo", "epochs": 2, "minibatch_size": 16},
                )
            ),
            await client.train_sft(
                {
                    "tenant": sft,
                    "dataset": "reach",
                    "steps": 30,
                    "batch_size": 4,
                    "token_budget": 8,
                    "head": {"kind": "flow", "action_dim": 2, "chunk_len": 2, "proprio_dim": 4},
                }
            ),
        ]
        results = await asyncio.gather(*(j.wait(500) for j in jobs))
    assert [r.status for r in results] == ["succeeded"] * 3
    assert [r.policy_version for r in results[:2]] == [3, 3]


@pytest.mark.timeout(400)
async def test_pipeline_sft_then_rl_then_eval(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    from services.envs.datasets import record

    start_rl_stack(nats_server.url, tmp_path / "logs", procs)
    record("JoyNexus/Reach2D-v0", 8, tmp_path / "reach", seed=0, env_kwargs=REACH_EASY)
    tenant = uid("pipe")
    head = {"kind": "oft", "action_dim": 2, "proprio_dim": 4, "value_head": True}
    async with await Client.connect(nats_server.url) as client:
        await register_path(client.js, tenant, "reach", tmp_path / "reach")
        job = await client.pipeline(
            {
                "tenant": tenant,
                "stages": [
                    {
                        "kind": "sft",
                        "tenant": tenant,
                        "dataset": "reach",
                        "head": head,
                        "steps": 10,
                        "batch_size": 4,
                        "token_budget": 8,
                    },
                    rl_spec(tenant, iterations=2),
                    {
                        "kind": "eval",
                        "tenant": tenant,
                        "policy_job": "filled-in-by-master",
                        "env": "JoyNexus/Reach2D-v0",
                        "env_kwargs": REACH_EASY,
                        "max_episode_steps": 20,
                        "episodes": 4,
                    },
                ],
            }
        )
        result = await job.wait(300)
        assert result.status == "succeeded"
        assert result.metrics["episodes"] == 4  # the eval stage's results
        stages = [await client.status(tenant, f"{job.job_id}-s{i}") for i in range(3)]
        assert [s.status for s in stages if s] == ["succeeded"] * 3
        rl_stage = parse(stages[1])
        eval_stage = parse(stages[2])
        assert rl_stage["init_from"] == f"{job.job_id}-s0"
        assert eval_stage["policy_job"] == f"{job.job_id}-s1"
        # The RL stage started from the SFT stage's final weights.
        rl_policy, _ = await policy_entry(js, tenant, f"{job.job_id}-s1")
        assert rl_policy is not None
        assert rl_policy.slot.init_object.startswith(f"{tenant}/{job.job_id}-s0/v")


def parse(record: Any) -> dict[str, Any]:
    import json

    return dict(json.loads(record.spec_json))


# Over the bus with the slow ones; PPO's learning runs in the default suite in process
# (tests/test_vla_rl.py, the same kernels), RL over the bus in tests/test_demo.py.
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_rl_improves_return_on_the_fast_env(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """PPO over the bus (fixed seeds): the final policy's deterministic return on fixed
    evaluation episodes beats the starting policy's (version 1) on the same episodes."""
    # Keep every version: the starting policy is evaluated after training.
    start_rl_stack(nats_server.url, tmp_path / "logs", procs, "--keep-versions", "100")
    tenant = uid("learn")
    async with await Client.connect(nats_server.url) as client:
        job = await client.train_rl(
            rl_spec(
                tenant,
                iterations=LEARN_ITERATIONS,
                episodes_per_iteration=16,
                parallel_envs=8,
                env_kwargs=REACH_STATE,
                head={"kind": "oft", "action_dim": 2, "proprio_dim": 6, "value_head": True},
                optimizer={"lr": 1e-4},
                rl={"epochs": 8, "minibatch_size": 64, "gamma": 0.9, "gae_lambda": 0.9},
            )
        )
        result = await job.wait(500)
        final = result.policy_version
        assert final == LEARN_ITERATIONS + 1

        async def evaluate(version: int) -> dict[str, float]:
            ev = await client.evaluate(
                {
                    "tenant": tenant,
                    "policy_job": job.job_id,
                    "policy_version": version,
                    "env": "JoyNexus/Reach2D-v0",
                    "env_kwargs": REACH_STATE,
                    "max_episode_steps": 20,
                    "episodes": 16,
                    "parallel_envs": 8,
                    "seed": 777,
                }
            )
            return (await ev.wait(300)).metrics

        before, after = await evaluate(1), await evaluate(final)
    print(
        f"return {before['mean_return']:.3f} -> {after['mean_return']:.3f}, success "
        f"{before['success_rate']:.2f} -> {after['success_rate']:.2f}"
    )
    assert after["mean_return"] > before["mean_return"] + 0.2
    assert after["success_rate"] >= before["success_rate"]


LEARN_ITERATIONS = 16
