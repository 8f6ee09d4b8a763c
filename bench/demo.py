"""``joynexus demo``: the paper's scenario, measured shared against isolated.

Three RL tenants (PushCube / oft / PPO, PullCube / discrete / GRPO, PickCube / flow / PPO)
and one SFT tenant (Reach2D, oft head) run on one local stack, twice, with the same specs and
seeds:

1. **isolated** — the traditional way: each tenant's job alone, one after another, holding
   the whole set of services (trainer, inferencer, env workers) for its duration;
2. **shared** — all four jobs at once on the same set.

The services measure themselves (busy: seconds computing; active: seconds with work in hand;
operation counts and cost fits) and report it in their heartbeats, which the demo samples.
It reports aggregate held time (the sum over services of time held), each service's
utilisation (busy / held) in both modes, every tenant's completion time and learning curve
in both (identical where the computation is deterministic), and where the rest of the time
went. It prints a table and writes a JSON result, an HTML report with plots, and the
measured per-operation costs that ``joynexus simulate`` reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench import scenario
from bench.demo_results import (
    CURVE_METRICS,
    JobTrace,
    PhaseRun,
    print_bills,
    print_table,
    summarise,
    tenant_bills,
)
from bench.gauges import SERVICES, Sampler
from bench.scenario import Budget, DemoConfig, DemoTenant, config_of
from bus.codec import DecodeError, decode, encode
from bus.connect import connect
from bus.identity import OPERATOR_NAME
from bus.local import StackInfo
from bus.usage import Bill, read_bill
from clients.sdk import Client, Job
from schemas import subjects
from schemas.envctl import PREWARMED_DECODER, EnvPrewarmed, PrewarmEnv
from schemas.events import PolicyPublished, Progress, Rejected, StateChanged
from schemas.jobs import TERMINAL_STATUSES
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from services.launcher import LocalStack
from services.stackops import wait_healthy

log = logging.getLogger(__name__)

PHASES = ("isolated", "shared")
#: A worker builds the sessions one at a time (ManiSkill: 1-6 s each).
PREWARM_TIMEOUT_S = 300.0
#: How often the roles report their usage per job during the demo (seconds).
USAGE_REPORT_S = 1.0


class Progressor:
    """The progress line: phase, tenant, position and an ETA from the work done so far
    (each tenant's job counts as one unit per phase)."""

    def __init__(self, budget: Budget, tty: bool) -> None:
        self.budget = budget
        self.tty = tty
        self.started = time.monotonic()
        self.phase = "warm-up"
        self.label = ""
        self.done: dict[tuple[str, str], float] = {}
        self._last_print = 0.0

    def update(self, phase: str, trace: JobTrace) -> None:
        self.phase, self.label = phase, trace.tenant.name
        if phase in PHASES:  # the warm-up's jobs are not the measured work
            units = scenario.units(trace.tenant, self.budget)
            self.done[(phase, trace.tenant.name)] = min(1.0, trace.done_units / units)
        self.show()

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_print < (0.5 if self.tty else 10.0):
            return
        self._last_print = now
        total = len(PHASES) * len(scenario.TENANTS)
        fraction = sum(self.done.values()) / total
        elapsed = now - self.started
        eta = elapsed * (1 - fraction) / fraction if fraction > 0.02 else float("nan")
        line = (
            f"[{self.phase}] {self.label:<14} {fraction:6.1%} of the work · elapsed "
            f"{_mmss(elapsed)} · ETA {_mmss(eta)}"
        )
        if self.tty:
            print("\r" + line.ljust(78), end="", flush=True)
        else:
            print(line, flush=True)

    def end_line(self) -> None:
        if self.tty:
            print(flush=True)


def _mmss(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "--:--"
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


# -- the stack and its tenants -----------------------------------------------------------------


def ensure_dataset(home: Path, budget: Budget) -> Path:
    """The SFT tenant's dataset: scripted Reach2D demonstrations (recorded once per home)."""
    path = home / "datasets" / f"reach2d-{budget.sft_episodes}"
    if not (path / "meta" / "info.json").exists():
        record(REACH2D_ID, budget.sft_episodes, path, seed=0, overwrite=True)
    return path


async def connect_tenants(info: StackInfo, stack: contextlib.AsyncExitStack) -> dict[str, Client]:
    """Each tenant connects as itself (its own creds: `joynexus up` made them)."""
    clients = {}
    for tenant in scenario.TENANTS:
        clients[tenant.name] = await stack.enter_async_context(
            await Client.connect(
                info.url, creds=info.creds(tenant.name), user=info.user, password=info.password
            )
        )
    return clients


async def submit(client: Client, spec: dict[str, Any], job_id: str) -> Job:
    if spec["kind"] == "rl":
        return await client.train_rl(spec, job_id=job_id)
    return await client.train_sft(spec, job_id=job_id)


async def follow(job: Job, trace: JobTrace, on_progress: Any) -> JobTrace:
    """Read the job's events to its end into ``trace``."""
    metrics = CURVE_METRICS[trace.tenant.kind]
    async for event in job.events(idle_timeout=600):
        match event:
            case PolicyPublished(version=1):
                trace.started = event.at
            case PolicyPublished(final=True):
                trace.final_at = event.at
            case Progress():
                for name in metrics:
                    trace.curve.setdefault(name, []).append(float(event.metrics.get(name, 0.0)))
                trace.done_units = event.step
                on_progress(trace)
            case Rejected():
                trace.status, trace.reason, trace.ended = "rejected", event.reason, event.at
            case StateChanged() if event.status in TERMINAL_STATUSES:
                trace.status, trace.reason, trace.ended = event.status, event.reason, event.at
    return trace


async def run_jobs(
    clients: dict[str, Client],
    tenants: list[DemoTenant],
    specs: dict[str, dict[str, Any]],
    job_ids: dict[str, str],
    phase: str,
    progress: Progressor,
) -> dict[str, JobTrace]:
    """Submit the tenants' jobs at once and follow them to their ends."""
    traces: dict[str, JobTrace] = {}
    jobs = []
    for tenant in tenants:
        traces[tenant.name] = JobTrace(tenant, job_ids[tenant.name], time.time())
        jobs.append(await submit(clients[tenant.name], specs[tenant.name], job_ids[tenant.name]))
    await asyncio.gather(
        *(
            follow(job, traces[t.name], lambda tr: progress.update(phase, tr))
            for job, t in zip(jobs, tenants, strict=True)
        )
    )
    failed = {t: f"{r.status}: {r.reason}" for t, r in traces.items() if r.status != "succeeded"}
    if failed:
        raise RuntimeError(f"{phase} phase: jobs did not succeed: {failed}")
    return traces


async def measured(
    sampler: Sampler, phase: PhaseRun, instances: dict[str, int], run: Any
) -> dict[str, JobTrace]:
    """Run ``run()`` (jobs from submit to end) as one measurement window of ``phase``."""
    await sampler.fresh(time.time())
    start = time.time()
    traces: dict[str, JobTrace] = await run()
    end = max(t.ended for t in traces.values())
    await sampler.fresh(end)
    phase.windows.append((start, end))
    window = sampler.totals(start, end)
    phase.window_totals[",".join(traces)] = window
    for service, values in window.items():
        acc = phase.totals.setdefault(service, {})
        for name, value in values.items():
            acc[name] = acc.get(name, 0.0) + value
        phase.held[service] = phase.held.get(service, 0.0) + instances[service] * (end - start)
    phase.jobs.update(traces)
    return traces


async def prewarm(
    nc: NATS, budget: Budget, workers: int, timeout: float = PREWARM_TIMEOUT_S
) -> None:
    """Have every env worker hold the sessions one RL tenant's iteration takes, of each
    RL tenant's env, built before anything is measured (a ManiSkill build costs seconds, and
    which worker runs which task is the broker's choice)."""
    sessions = math.ceil(budget.rl_episodes / budget.rl_parallel_envs) * budget.rl_parallel_envs
    for tenant in scenario.TENANTS:
        if tenant.kind != "rl":
            continue
        request = PrewarmEnv(
            tenant.target,
            sessions,
            image_size=scenario.IMAGE_SIZE,
            max_episode_steps=budget.rl_episode_steps,
        )
        inbox = nc.new_inbox()
        answers: asyncio.Queue[EnvPrewarmed] = asyncio.Queue()

        async def collect(msg: Msg, answers: asyncio.Queue[EnvPrewarmed] = answers) -> None:
            with contextlib.suppress(DecodeError):
                await answers.put(decode(PREWARMED_DECODER, msg.data))

        sub = await nc.subscribe(inbox, cb=collect)
        try:
            await nc.publish(subjects.ENVS_PREWARM, encode(request), reply=inbox)
            for _ in range(workers):
                answer = await asyncio.wait_for(answers.get(), timeout)
                if answer.error:
                    raise RuntimeError(f"{answer.instance}: {tenant.target}: {answer.error}")
                print(
                    f"  {answer.instance}: {answer.idle} {tenant.target} sessions ready "
                    f"({answer.built} built)",
                    flush=True,
                )
        finally:
            await sub.unsubscribe()


async def run_phases(
    config: DemoConfig, info: StackInfo, data: Path
) -> tuple[dict[str, PhaseRun], Sampler, dict[str, int], Bill]:
    budget = config.budget
    tenants = list(scenario.TENANTS)
    progress = Progressor(budget, sys.stdout.isatty())
    stamp = time.strftime("%H%M%S")
    nc = await connect(
        info.url, creds=info.creds(OPERATOR_NAME), user=info.user, password=info.password
    )
    sampler = Sampler(nc.jetstream())
    sampling = asyncio.create_task(sampler.run())
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = await connect_tenants(info, stack)
            for tenant in tenants:
                if tenant.kind == "sft":
                    await clients[tenant.name].push_dataset(tenant.name, data, tenant.target)
            print("warm-up: every env worker builds the simulators the tasks will use", flush=True)
            await prewarm(nc, budget, config.env_workers)
            print("warm-up: a short job per tenant touches every code path", flush=True)
            warm = {t.name: scenario.warmup_spec(t, budget, t.name) for t in tenants}
            await run_jobs(
                clients,
                tenants,
                warm,
                {t.name: f"warm-{stamp}-{t.name}" for t in tenants},
                "warm-up",
                progress,
            )
            instances = sampler.instances()
            missing = [s for s in SERVICES if not instances.get(s)]
            if missing:
                raise RuntimeError(f"no heartbeat with gauges from the {missing} services")
            specs = {t.name: scenario.job_spec(t, budget, seed=config.seed) for t in tenants}
            phases = {name: PhaseRun(name) for name in PHASES}
            progress.started = time.monotonic()
            for tenant in tenants:

                async def alone(tenant: DemoTenant = tenant) -> dict[str, JobTrace]:
                    ids = {tenant.name: f"iso-{stamp}-{tenant.name}"}
                    return await run_jobs(clients, [tenant], specs, ids, "isolated", progress)

                await measured(sampler, phases["isolated"], instances, alone)

            async def together() -> dict[str, JobTrace]:
                ids = {t.name: f"shared-{stamp}-{t.name}" for t in tenants}
                return await run_jobs(clients, tenants, specs, ids, "shared", progress)

            await measured(sampler, phases["shared"], instances, together)
            progress.show(force=True)
            progress.end_line()
            # Each role reports its usage every USAGE_REPORT_S: wait for the last reports.
            await asyncio.sleep(2 * USAGE_REPORT_S)
            return phases, sampler, instances, await read_bill(nc.jetstream())
    finally:
        sampler.stop()
        await sampling
        await nc.close()


def write_raw(phases: dict[str, PhaseRun], sampler: Sampler, path: Path) -> None:
    """Everything measured, as measured: the phases' jobs and windows, every heartbeat."""
    raw = {
        "phases": {name: dataclasses.asdict(phase) for name, phase in phases.items()},
        "readings": {k: [dataclasses.asdict(r) for r in v] for k, v in sampler.readings.items()},
    }
    path.write_text(json.dumps(raw))


def run(config: DemoConfig) -> int:
    config.out_dir.mkdir(parents=True, exist_ok=True)
    budget = config.budget
    print(
        f"JoyNexus demo{' (quick)' if config.quick else ''}: 3 RL tenants + 1 SFT tenant, "
        f"isolated one after another, then shared (home {config.home})",
        flush=True,
    )
    for tenant in scenario.TENANTS:
        print(f"  {tenant.label}")
    data = ensure_dataset(config.home, budget)
    stack = LocalStack(
        config.home,
        tenants=tuple(t.name for t in scenario.TENANTS),
        roles={"master": 1, "trainer": 1, "inferencer": 1, "envs": config.env_workers, "health": 1},
        # Twice a second: the utilisation timeline's resolution.
        extra_env={
            "JOYNEXUS_HEARTBEAT_INTERVAL_S": "0.5",
            "JOYNEXUS_USAGE_REPORT_S": str(USAGE_REPORT_S),
        },
    )
    try:
        info = stack.start_server()
        stack.start_roles()
        print(f"bus: {info.url}; waiting for the services (model load)", flush=True)
        # The health manager restarts a role by asking it to exit: something must start it
        # again, as `joynexus up` does.
        with stack.supervising():
            _, missing = asyncio.run(wait_healthy(info, stack.expected_roles, 180))
            if missing:
                print(f"roles did not come up: {missing}; see {config.home}/logs", file=sys.stderr)
                return 1
            phases, sampler, instances, bill = asyncio.run(run_phases(config, info, data))
    finally:
        stack.stop()
    write_raw(phases, sampler, config.out_dir / "raw.json")
    result = summarise(config, phases)
    result["usage"] = tenant_bills(bill, phases)
    from bench import demo_costs, report

    costs = demo_costs.measure(phases, instances, budget)
    costs_path = config.costs_path or config.out_dir / "costs.json"
    demo_costs.write(costs, costs_path)
    result["costs"] = str(costs_path)
    result["simulated"] = demo_costs.validate(costs, result)
    report_path = config.report_path or config.out_dir / "report.html"
    report.write(result, phases, sampler, report_path)
    result["report"] = str(report_path)
    print_table(result)
    print_bills(result["usage"])
    print(f"\nreport: {report_path}\ncosts (for `joynexus simulate --costs`): {costs_path}")
    if config.json_path:
        config.json_path.parent.mkdir(parents=True, exist_ok=True)
        config.json_path.write_text(json.dumps(result, indent=2))
        print(f"json: {config.json_path}")
    print("demo succeeded")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--home", type=Path, default=Path(".joynexus"))
    scenario.add_arguments(p)
    args = p.parse_args(argv)
    return run(config_of(args, args.home))


if __name__ == "__main__":
    raise SystemExit(main())
