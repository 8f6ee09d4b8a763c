"""From what the demo measured to what the simulator reads: per-operation costs and the
workload, per phase, and the simulator's predictions of the demo's own results.

Costs come from the services' gauges over each phase (:mod:`bench.gauges`) and from the jobs'
events; nothing here is assumed. The isolated phase's costs are the services' own (one
tenant's work at a time: nothing contends for the cores); the shared phase's include the
contention of four tenants' work on the same cores. Each phase is simulated with its own
costs, which is what the validation compares; projections to dedicated devices use the
isolated phase's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from bench import scenario
from bench.scenario import Budget
from bench.servicemodel import Costs, TenantLoad, Topology
from bench.simulate import CostsFile, DemoCosts, compare, summary
from bus.metering import fit

if TYPE_CHECKING:
    from bench.demo_results import PhaseRun

#: What the validation compares, and how close the simulation must come (the issue's bound).
VALIDATED = (
    "aggregate_isolated_s",
    "aggregate_multi_s",
    "train_util_isolated",
    "train_util_multi",
    "infer_util_isolated",
    "infer_util_multi",
)
TOLERANCE = 0.15


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def phase_costs(phase: PhaseRun) -> Costs:
    """The per-operation costs the services measured over ``phase`` (env costs are the
    defaults for tenants without their own: see :func:`tenant_loads`)."""
    train, infer, env = phase.totals["train"], phase.totals["infer"], phase.totals["env"]
    sft_fixed, sft_per_sample, sft_rounds = fit(train, "sft_step")
    rl_fixed, rl_per_sample, _ = fit(train, "rl_update")
    act_fixed, act_per_obs, batches = fit(infer, "act_batch")
    # An act request's round trip at the env worker, less its time inside the inferencer,
    # is its two hops over the bus.
    latency = _ratio(env.get("act_wait_s", 0.0), env.get("act_requests", 0.0))
    residence = _ratio(infer.get("residence_s", 0.0), infer.get("requests_served", 0.0))
    jobs = list(phase.jobs.values())
    starts = [j.started - j.submitted for j in jobs if j.started]
    ends = [j.ended - j.final_at for j in jobs if j.final_at]
    overall = env_costs(env, "")
    return Costs(
        sft_step_s=sft_fixed,
        sft_per_sample_s=sft_per_sample,
        sft_round_overhead_s=_ratio(
            train.get("round_s", 0.0) - train.get("sft_step_s", 0.0), sft_rounds
        ),
        rl_update_s=rl_fixed,
        rl_per_sample_s=rl_per_sample,
        commit_s=_ratio(train.get("commit_s", 0.0), train.get("commits", 0.0)),
        act_batch_s=act_fixed,
        act_per_sample_s=act_per_obs,
        env_step_s=overall["env_step_s"],
        env_step_cv=overall["env_step_cv"],
        reset_s=overall["reset_s"],
        env_step_overhead_s=overall["env_step_overhead_s"],
        hop_s=max(0.0, (latency - residence) / 2) if batches else 0.0,
        job_start_s=_ratio(sum(starts), len(starts)),
        job_end_s=_ratio(sum(ends), len(ends)),
    )


def env_costs(env: dict[str, float], env_id: str) -> dict[str, float]:
    """An env id's step, reset and per-lockstep overhead seconds from the env workers'
    gauges (``env_id`` "": over every env)."""
    prefix = f"env.{env_id}." if env_id else ""

    def g(name: str) -> float:
        return env.get(prefix + name, 0.0)

    other = g("task_s") - g("reset_s") - g("step_s") - g("act_wait_s")
    call_s = _ratio(g("step_s"), g("step_calls"))
    variance = max(0.0, _ratio(g("step_s2"), g("step_calls")) - call_s * call_s)
    return {
        "env_step_s": _ratio(g("step_s"), g("steps")),
        "env_step_cv": math.sqrt(variance) / call_s if call_s > 0 else 0.0,
        "reset_s": _ratio(g("reset_s"), g("resets")),
        "env_step_overhead_s": max(0.0, _ratio(other, g("act_requests"))),
        "episode_steps": _ratio(g("steps"), g("episodes")),
    }


def tenant_loads(phase: PhaseRun, budget: Budget) -> list[TenantLoad]:
    """The scenario's jobs in the simulator's units, each RL tenant with the env costs and
    episode length measured of its env over the phase."""
    env = phase.totals["env"]
    loads = []
    for tenant in scenario.TENANTS:
        if tenant.kind == "sft":
            loads.append(
                TenantLoad(
                    tenant.name,
                    "sft",
                    budget.sft_steps,
                    batch_size=budget.sft_batch,
                    checkpoint_every=scenario.SFT_CHECKPOINT_EVERY,
                )
            )
            continue
        measured = env_costs(env, tenant.target)
        loads.append(
            TenantLoad(
                tenant.name,
                "rl",
                budget.rl_iterations,
                episodes_per_iteration=budget.rl_episodes,
                parallel_envs=budget.rl_parallel_envs,
                episode_steps=measured["episode_steps"] or float(budget.rl_episode_steps),
                chunk_len=int(tenant.head.get("chunk_len", 1)),
                env_step_s=measured["env_step_s"],
                env_step_cv=measured["env_step_cv"],
                reset_s=measured["reset_s"],
                env_step_overhead_s=measured["env_step_overhead_s"],
            )
        )
    return loads


def measure(phases: dict[str, PhaseRun], instances: dict[str, int], budget: Budget) -> DemoCosts:
    topology = Topology(
        train=instances.get("train", 1),
        infer=instances.get("infer", 1),
        env=instances.get("env", 1),
    )
    iso, shared = phases["isolated"], phases["shared"]
    return DemoCosts(
        CostsFile(phase_costs(iso), topology, tenant_loads(iso, budget)),
        CostsFile(phase_costs(shared), topology, tenant_loads(shared, budget)),
    )


def write(costs: DemoCosts, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(costs)))


def validate(costs: DemoCosts, result: dict[str, Any]) -> dict[str, Any]:
    """Simulate each phase with its own measured costs; compare with the measurement."""
    iso = summary(compare(costs.isolated.costs, costs.isolated.topology, costs.isolated.tenants))
    shared = summary(compare(costs.shared.costs, costs.shared.topology, costs.shared.tenants))
    predicted = {
        key: float(iso[key] if key.endswith("isolated") or "isolated" in key else shared[key])
        for key in VALIDATED
    }
    measured = {key: float(result[key]) for key in VALIDATED}
    errors = {key: predicted[key] / measured[key] - 1.0 for key in VALIDATED if measured[key]}
    return {
        "measured": measured,
        "predicted": predicted,
        "relative_error": errors,
        "within_tolerance": all(abs(e) <= TOLERANCE for e in errors.values()),
        "tolerance": TOLERANCE,
    }
