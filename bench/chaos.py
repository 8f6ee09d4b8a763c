"""``joynexus chaos``: a mixed 3-tenant workload while roles are SIGKILLed at random times.

On one local stack (supervised as ``joynexus up`` supervises it), three tenants run at once:
SFT on Reach2D demonstrations (OFT head), RL with PPO (OFT head with a value head) and RL with
GRPO (discrete head, rollouts allowed one policy version behind), all on the ``tiny``
backbone. The same three jobs run twice:

1. **reference** — no fault, twice at once (a job whose two runs end with different
   parameters is not reproducible bit for bit even without faults: its parameters are
   reported, not compared; nor are any job's where this CPU's kernels are not
   batch-invariant, :func:`vla.numerics.batch_invariant`: a sample's bits then depend on its
   batch-mates, and batches form by timing, so two runs agree only by luck);
2. **chaos** — the same specs and seeds while a seeded schedule SIGKILLs a random role
   (trainer, inferencer, env worker, master; with ``--broker`` also the NATS server, started
   again on the same store) every few seconds, each kill after the previous one recovered.

Then it checks what a tenant would: every accepted job reached a terminal state and
succeeded; each job's steps (SFT) or iterations (RL) were reported exactly once each —
``lost`` counts the missing ones and the jobs that did not succeed, ``duplicated`` those
reported twice (a batch or rollout applied twice shows as a repeated or a different step);
and every tenant's final parameters equal the reference run's (``params_equal``: the trainer
runs ``--deterministic``; asked of the reproducible jobs only). ``recovery_s`` of a kill is
the time from the SIGKILL until the role's replacement (every role, for the broker)
heartbeats again; the table gives the largest. The result is printed as a table and
written as JSON (``--json``).

``--cluster`` runs the stack on a 3-node JetStream cluster (everything at 3 replicas) and
adds a node to the targets: SIGKILLed, left down 1-5 s while the others carry on, then
started again on its store (it rejoins); its recovery is until every role heartbeats again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from bench.chaos_checks import Outcome, check, final_policy, reported
from bench.chaos_config import ChaosConfig, add_arguments, config_of
from bus.codec import DecodeError, decode
from bus.connect import connect
from bus.kv import kv_values
from bus.local import StackInfo
from clients.sdk import Client, Job
from schemas import subjects
from schemas.health import HEARTBEAT_DECODER
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from services.launcher import LocalStack
from services.stackops import wait_healthy
from vla.numerics import batch_invariant

#: The roles a kill picks from (the health manager is left to watch them).
TARGETS = ("trainer", "inferencer", "envs", "master")
BROKER = "broker"
#: One node of a 3-node cluster (``--cluster``).
NODE = "node"
ROLES = {"master": 1, "trainer": 1, "inferencer": 1, "envs": 2, "health": 1}
#: The longest a role may take to come back before the run gives up on it.
RECOVERY_TIMEOUT_S = 120.0
REACH = {"num_distractors": 0, "max_speed": 0.2}


@dataclass
class Kill:
    """One SIGKILL and how long its target took to come back."""

    target: str
    at_s: float
    pid: int
    recovery_s: float = 0.0
    #: How long a cluster node was left down on purpose before its restart.
    down_s: float = 0.0


def tenants() -> dict[str, str]:
    """tenant → what it runs."""
    return {"chaos-sft": "sft", "chaos-ppo": "rl", "chaos-grpo": "rl"}


def specs(config: ChaosConfig) -> dict[str, dict[str, Any]]:
    rl = {
        "kind": "rl",
        "env": "JoyNexus/Reach2D-v0",
        "env_kwargs": REACH,
        "max_episode_steps": 16,
        "iterations": config.iterations,
        "episodes_per_iteration": 4,
        "parallel_envs": 2,
        "token_budget": 8,
        "seed": config.seed + 3,
        "optimizer": {"lr": 3e-3},
    }
    return {
        "chaos-sft": {
            "kind": "sft",
            "tenant": "chaos-sft",
            "dataset": "reach",
            "head": {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4},
            "steps": config.steps,
            "batch_size": 8,
            "seed": config.seed + 7,
            "checkpoint_every": 5,
            "optimizer": {"lr": 3e-3},
        },
        "chaos-ppo": {
            **rl,
            "tenant": "chaos-ppo",
            "head": {"kind": "oft", "action_dim": 2, "proprio_dim": 4, "value_head": True},
            "rl": {"algorithm": "ppo", "epochs": 2, "minibatch_size": 16},
        },
        "chaos-grpo": {
            **rl,
            "tenant": "chaos-grpo",
            "head": {"kind": "discrete", "action_dim": 2, "proprio_dim": 4, "chunk_len": 1},
            # Rollouts one version behind: iteration i+1 is collected while i trains.
            "rl": {"algorithm": "grpo", "epochs": 2, "minibatch_size": 16, "max_policy_lag": 1},
        },
    }


async def submit_all(client: Client, config: ChaosConfig, prefix: str) -> dict[str, Job]:
    jobs = {}
    for tenant, spec in specs(config).items():
        job_id = f"{prefix}-{tenant}"
        if spec["kind"] == "rl":
            jobs[tenant] = await client.train_rl(spec, job_id=job_id)
        else:
            jobs[tenant] = await client.train_sft(spec, job_id=job_id)
    return jobs


class Killer:
    """Picks targets with a seeded generator, SIGKILLs them, waits for them to come back."""

    def __init__(self, stack: LocalStack, js: JetStreamContext, config: ChaosConfig) -> None:
        self.stack = stack
        self.js = js
        self.config = config
        self.rng = random.Random(config.seed)
        self.targets = (
            *TARGETS,
            *((BROKER,) if config.broker else ()),
            *((NODE,) if config.cluster else ()),
        )
        self.kills: list[Kill] = []
        self.t0 = time.monotonic()

    async def run(self, done: asyncio.Event) -> None:
        config = self.config
        gap = config.duration_s / config.kills if config.duration_s else config.gap_s
        # Every target in turn, in a new seeded order each round: each role is hit as often.
        schedule: list[str] = []
        while len(schedule) < config.kills:
            schedule += self.rng.sample(self.targets, len(self.targets))
        for target in schedule[: config.kills]:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), self.rng.uniform(0.5 * gap, 1.5 * gap))
            if done.is_set():
                return
            await self.kill(target)

    async def kill(self, target: str) -> None:
        at = time.monotonic()
        since = time.time()
        if target == BROKER:
            server = self.stack.server
            assert server is not None
            kill = Kill(target, at - self.t0, server.pid or 0)
            server.kill()
            await asyncio.sleep(0.5)  # down long enough for every client to notice
            await asyncio.to_thread(server.restart)
            roles = list(TARGETS)
        elif target == NODE:
            nodes = self.stack.nodes
            assert nodes is not None
            index = self.rng.randrange(len(nodes.nodes))
            kill = Kill(f"node-{index + 1}", at - self.t0, nodes.nodes[index].pid or 0)
            nodes.kill(index)
            # Down a while (the others carry on), then started again on its store: it rejoins.
            await asyncio.sleep(self.rng.uniform(1.0, 5.0))
            await asyncio.to_thread(nodes.restart, index)
            kill.down_s = time.monotonic() - at
            at, since = time.monotonic(), time.time()  # its recovery counts from its restart
            roles = list(TARGETS)
        else:
            child = self.stack.live(target)[self.rng.randrange(len(self.stack.live(target)))]
            assert child.proc is not None
            kill = Kill(target, at - self.t0, child.proc.pid)
            child.proc.kill()
            roles = [target]
        self.kills.append(kill)
        await asyncio.wait_for(self.back(roles, kill.pid, since), RECOVERY_TIMEOUT_S)
        kill.recovery_s = time.monotonic() - at
        print(
            f"  kill {len(self.kills):>2}: {target:<10} pid {kill.pid:<7} back in "
            f"{kill.recovery_s:5.1f} s",
            flush=True,
        )

    async def back(self, roles: list[str], pid: int, since: float) -> None:
        """Until each role has an instance that heartbeat after ``since``: a new one for a
        killed role, any for the broker (every connection came back)."""
        waiting = set(roles)
        while waiting:
            for role in list(waiting):
                try:
                    beats = await kv_values(self.js, subjects.KV_HEARTBEATS, f"{role}.")
                except (NatsError, TimeoutError):
                    continue  # the broker is coming back
                for value in beats.values():
                    with contextlib.suppress(DecodeError):
                        beat = decode(HEARTBEAT_DECODER, value)
                        new = beat.pid != pid and beat.started_at > since - 1.0
                        if beat.at > since and (new or len(roles) > 1):
                            waiting.discard(role)
            if waiting:
                await asyncio.sleep(0.2)


async def phase(
    client: Client, config: ChaosConfig, prefix: str, killer: Killer | None
) -> tuple[dict[str, Job], dict[str, Outcome], float]:
    t0 = time.monotonic()
    jobs = await submit_all(client, config, prefix)
    done = asyncio.Event()
    kills = asyncio.create_task(killer.run(done)) if killer else None
    try:
        outcomes = dict(
            zip(jobs, await asyncio.gather(*(reported(j) for j in jobs.values())), strict=True)
        )
    finally:
        done.set()
        if kills is not None:
            await kills
    return jobs, outcomes, time.monotonic() - t0


async def drive(
    stack: LocalStack, info: StackInfo, config: ChaosConfig, invariant: bool
) -> dict[str, Any]:
    """Push the dataset, run the fault-free pair and then the jobs under kills, and check
    them. ``invariant``: whether this CPU's kernels are batch-invariant (only then can a
    job's parameters be compared bit for bit)."""
    nc = await connect(info.url, user=info.user, password=info.password, name="chaos")
    client = Client(nc)
    try:
        data = config.home / "datasets" / "reach2d-16"
        if not (data / "meta" / "info.json").exists():
            record(REACH2D_ID, 16, data, seed=0, overwrite=True)
        for tenant in tenants():
            await client.push_dataset(tenant, data, "reach")
        stamp = time.strftime("%H%M%S")
        print(
            f"reference: {', '.join(tenants())} twice at once without faults (what reruns bit "
            "for bit)",
            flush=True,
        )
        (ref_jobs, ref_outcomes, ref_wall), (rerun_jobs, rerun_outcomes, _) = await asyncio.gather(
            phase(client, config, f"ref-{stamp}", None),
            phase(client, config, f"rerun-{stamp}", None),
        )
        for tenant, ref in ref_outcomes.items():
            if ref.status != "succeeded":
                raise RuntimeError(f"the reference job of {tenant} {ref.status}: {ref.reason}")
        what = " and the broker" if config.broker else ""
        print(f"chaos: the same jobs while {config.kills} SIGKILLs hit the roles{what}", flush=True)
        killer = Killer(stack, nc.jetstream(), config)
        jobs, outcomes, wall = await phase(client, config, f"chaos-{stamp}", killer)
        checks = []
        for tenant, kind in tenants().items():
            expected = config.steps if kind == "sft" else config.iterations
            ref_final = await final_policy(client.js, tenant, ref_jobs[tenant].job_id)
            got = await final_policy(client.js, tenant, jobs[tenant].job_id)
            rerun = await final_policy(client.js, tenant, rerun_jobs[tenant].job_id)
            ref = ref_outcomes[tenant]
            job = check(tenant, kind, expected, outcomes[tenant], ref, got, ref_final.params)
            again = check(
                tenant, kind, expected, rerun_outcomes[tenant], ref, rerun, ref_final.params
            )
            job.reproducible = invariant and again.params_equal
            job.fault_free_param_diff = again.max_param_diff
            checks.append(job)
    finally:
        await nc.close()
    kills = killer.kills
    result: dict[str, Any] = {
        "kills": len(kills),
        "kills_asked": config.kills,
        "broker": config.broker,
        "cluster": config.cluster,
        "jobs": len(checks),
        "succeeded": sum(c.status == "succeeded" for c in checks),
        "lost": sum(c.lost for c in checks),
        "duplicated": sum(c.duplicated for c in checks),
        # Asked where the job reruns bit for bit without faults (see JobCheck.reproducible).
        "params_equal": all(c.params_equal for c in checks if c.reproducible),
        "reproducible": [c.tenant for c in checks if c.reproducible],
        "batch_invariant": invariant,
        "max_recovery_s": round(max((k.recovery_s for k in kills), default=0.0), 2),
        "reference_wall_s": round(ref_wall, 1),
        "chaos_wall_s": round(wall, 1),
        "kill_log": [asdict(k) for k in kills],
        "checks": [asdict(c) for c in checks],
        "seed": config.seed,
    }
    result["ok"] = (
        result["lost"] == 0
        and result["duplicated"] == 0
        and result["params_equal"]
        and result["kills"] == config.kills
    )
    return result


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{'tenant':<12} {'kind':<5} {'status':<10} {'applied':>9} {'lost':>5} "
        f"{'dup':>4} {'params':>7} {'max diff':>10} {'rerun diff':>10}"
    )
    for c in result["checks"]:
        print(
            f"{c['tenant']:<12} {c['kind']:<5} {c['status']:<10} "
            f"{c['applied']:>4}/{c['expected']:<4} {c['lost']:>5} {c['duplicated']:>4} "
            f"{'equal' if c['params_equal'] else 'DIFFER':>7} {c['max_param_diff']:>10.2e} "
            f"{c['fault_free_param_diff']:>10.2e}"
        )
    if not result["batch_invariant"]:
        print(
            "params: not compared; this CPU's kernels are not batch-invariant (a sample's bits "
            "depend on its batch-mates, and batches form by timing): the diffs are reported"
        )
    by_target: dict[str, list[float]] = {}
    for k in result["kill_log"]:
        by_target.setdefault(k["target"], []).append(k["recovery_s"])
    print(f"\n{'target':<11} {'kills':>5} {'max recovery s':>15}")
    for target, times in sorted(by_target.items()):
        print(f"{target:<11} {len(times):>5} {max(times):>15.1f}")
    print(
        f"\nkills {result['kills']}/{result['kills_asked']} · lost {result['lost']} · duplicated "
        f"{result['duplicated']} · params_equal {result['params_equal']} · max_recovery_s "
        f"{result['max_recovery_s']} · wall {result['reference_wall_s']} s reference (two "
        f"runs at once), {result['chaos_wall_s']} s with faults · ok {result['ok']}"
    )


def run(config: ChaosConfig) -> int:
    invariant = batch_invariant()
    stack = LocalStack(
        config.home,
        roles=dict(ROLES),
        auth=False,
        tenants=(),
        role_args={"trainer": ["--deterministic"]},
        cluster=3 if config.cluster else 1,
        extra_env={"JOYNEXUS_HEARTBEAT_INTERVAL_S": "0.5"},
    )
    try:
        info = stack.start_server()
        stack.start_roles()
        print(f"JoyNexus chaos: stack under {config.home} (logs in {config.home}/logs)", flush=True)
        with stack.supervising():  # as `joynexus up` does: restart what exits
            _, missing = asyncio.run(wait_healthy(info, stack.expected_roles, 180))
            if missing:
                print(f"roles did not come up: {missing}", file=sys.stderr)
                return 1
            result = asyncio.run(drive(stack, info, config, invariant))
    finally:
        stack.stop()
    print_table(result)
    if config.json_path:
        config.json_path.parent.mkdir(parents=True, exist_ok=True)
        config.json_path.write_text(json.dumps(result, indent=2))
        print(f"json: {config.json_path}")
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--home", type=Path, default=Path(".joynexus-chaos"))
    add_arguments(p)
    args = p.parse_args(argv)
    return run(config_of(args, args.home))


if __name__ == "__main__":
    raise SystemExit(main())
