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
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench import scenario
from bench.gauges import SERVICES, Sampler
from bench.scenario import Budget, DemoTenant
from bus.codec import DecodeError, decode, encode
from bus.connect import connect
from bus.identity import OPERATOR_NAME
from bus.local import StackInfo
from clients.sdk import Client, Job
from schemas import subjects
from schemas.envctl import PREWARMED_DECODER, EnvPrewarmed, PrewarmEnv
from schemas.events import PolicyPublished, Progress, Rejected, StateChanged
from schemas.jobs import TERMINAL_STATUSES
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from services.launcher import LocalStack, wait_healthy

log = logging.getLogger(__name__)

#: The per-iteration (RL) or per-step (SFT) metrics compared between the two phases.
CURVE_METRICS = {"rl": ("return_mean", "policy_loss", "episode_length"), "sft": ("loss",)}
#: What each kind's final metric is (the mean of the last ``FINAL_WINDOW`` values for SFT).
FINAL_METRIC = {"rl": "return_mean", "sft": "loss"}
FINAL_WINDOW = 10
PHASES = ("isolated", "shared")
#: A worker builds the sessions one at a time (ManiSkill: 1-6 s each).
PREWARM_TIMEOUT_S = 300.0


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
        return scenario.QUICK if self.quick else scenario.DEFAULT

    @property
    def out_dir(self) -> Path:
        return self.home / "demo"


@dataclass
class JobTrace:
    """One tenant's job in one phase, from its events."""

    tenant: DemoTenant
    job_id: str
    submitted: float
    #: When its first policy version (the initial weights) was committed: work begins.
    started: float = 0.0
    ended: float = 0.0
    #: When its final policy version was committed.
    final_at: float = 0.0
    status: str = "unknown"
    reason: str = ""
    #: Per iteration (RL) or step (SFT): the metrics of :data:`CURVE_METRICS`.
    curve: dict[str, list[float]] = field(default_factory=dict)
    done_units: int = 0

    @property
    def wall_s(self) -> float:
        return self.ended - self.submitted

    def final_metric(self) -> float:
        values = self.curve.get(FINAL_METRIC[self.tenant.kind], [])
        if not values:
            return float("nan")
        window = values[-FINAL_WINDOW:] if self.tenant.kind == "sft" else values[-1:]
        return sum(window) / len(window)


@dataclass
class PhaseRun:
    """One phase: its jobs, its measurement windows and what the services measured."""

    name: str
    jobs: dict[str, JobTrace] = field(default_factory=dict)
    #: ``[start, end]`` wall-time windows during which services were held (isolated: one
    #: per job; shared: one).
    windows: list[tuple[float, float]] = field(default_factory=list)
    #: Per service, the increase of every gauge over the windows, summed.
    totals: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Per service, instances times window length, summed.
    held: dict[str, float] = field(default_factory=dict)
    #: The totals of each window alone, by the tenants whose jobs ran in it.
    window_totals: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @property
    def start(self) -> float:
        return self.windows[0][0]

    @property
    def end(self) -> float:
        return self.windows[-1][1]

    @property
    def wall_s(self) -> float:
        return sum(b - a for a, b in self.windows)

    def utilisation(self, service: str) -> float:
        held = self.held.get(service, 0.0)
        return self.totals[service].get("busy_s", 0.0) / held if held else 0.0

    @property
    def aggregate_s(self) -> float:
        return sum(self.held.values())


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
) -> tuple[dict[str, PhaseRun], Sampler, dict[str, int]]:
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
            return phases, sampler, instances
    finally:
        sampler.stop()
        await sampling
        await nc.close()


# -- results -----------------------------------------------------------------------------------


def curves_identical(a: JobTrace, b: JobTrace) -> tuple[bool, float]:
    """Whether the two runs' curves are the same numbers, and their largest difference."""
    worst = 0.0
    same = True
    for name in CURVE_METRICS[a.tenant.kind]:
        x, y = a.curve.get(name, []), b.curve.get(name, [])
        if len(x) != len(y):
            return False, float("inf")
        same = same and x == y
        worst = max([worst, *(abs(p - q) for p, q in zip(x, y, strict=True))])
    return same, worst


def breakdown(phase: PhaseRun) -> dict[str, dict[str, float]]:
    """Per service: held, busy (computing), overhead (work in hand, not computing: decoding,
    waiting on another service, batching, bus round trips), commits (the trainer's checkpoint
    commits, part of its overhead), and idle (no work in hand)."""
    out = {}
    for service in SERVICES:
        t = phase.totals.get(service, {})
        held = phase.held.get(service, 0.0)
        busy = t.get("busy_s", 0.0)
        active = max(busy, t.get("active_s", busy))
        out[service] = {
            "held_s": held,
            "busy_s": busy,
            "overhead_s": active - busy,
            "idle_s": max(0.0, held - active),
            "commit_s": t.get("commit_s", 0.0),
            "utilisation": busy / held if held else 0.0,
        }
    return out


def waits(phase: PhaseRun) -> dict[str, float]:
    """Where a unit of work waited, in milliseconds: an SFT batch from its publish to its
    step (TRAIN and the trainer's buffers); an act request's round trip at the env worker,
    of it the time inside the inferencer, of that the batch's forward."""
    train, infer, env = phase.totals["train"], phase.totals["infer"], phase.totals["env"]

    def ms(seconds: float, count: float) -> float:
        return 1000.0 * seconds / count if count else 0.0

    return {
        "train_batch_wait_ms": ms(train.get("queue_wait_s", 0.0), train.get("queued", 0.0)),
        "act_round_trip_ms": ms(env.get("act_wait_s", 0.0), env.get("act_requests", 0.0)),
        "act_in_inferencer_ms": ms(
            infer.get("residence_s", 0.0), infer.get("requests_served", 0.0)
        ),
        "act_forward_ms": ms(infer.get("busy_s", 0.0), infer.get("act_batch_n", 0.0)),
        "observations_per_forward": (
            infer.get("act_batch_units", 0.0) / infer["act_batch_n"]
            if infer.get("act_batch_n")
            else 0.0
        ),
    }


def summarise(config: DemoConfig, phases: dict[str, PhaseRun]) -> dict[str, Any]:
    iso, shared = phases["isolated"], phases["shared"]
    result: dict[str, Any] = {
        "quick": config.quick,
        "budget": vars(config.budget),
        "topology": {"train": 1, "infer": 1, "env": config.env_workers},
        "isolated_wall_s": iso.wall_s,
        "multi_wall_s": shared.wall_s,
        "aggregate_isolated_s": iso.aggregate_s,
        "aggregate_multi_s": shared.aggregate_s,
        "aggregate_time_reduction": 1.0 - shared.aggregate_s / iso.aggregate_s,
    }
    for service, key in (("train", "train"), ("infer", "infer"), ("env", "env")):
        result[f"{key}_util_isolated"] = iso.utilisation(service)
        result[f"{key}_util_multi"] = shared.utilisation(service)
        result[f"{key}_util_ratio"] = (
            shared.utilisation(service) / iso.utilisation(service)
            if iso.utilisation(service)
            else float("nan")
        )
        # The same work (the curves say so) took this many times the compute seconds when
        # shared: the tenants' processes contend for this machine's cores.
        iso_busy = iso.totals[service].get("busy_s", 0.0)
        result[f"{key}_busy_inflation"] = (
            shared.totals[service].get("busy_s", 0.0) / iso_busy if iso_busy else float("nan")
        )
    # The work's own compute (what the services measured in the isolated phase, where
    # nothing contended) per second of each phase: how many cores it kept busy on average.
    work_s = sum(iso.totals[s].get("busy_s", 0.0) for s in SERVICES)
    result["cores"] = os.cpu_count() or 1
    result["work_compute_s"] = work_s
    result["cores_in_use_isolated"] = work_s / iso.wall_s
    result["cores_in_use_multi"] = work_s / shared.wall_s
    elapsed = 0.0
    tenants = []
    for tenant in scenario.TENANTS:
        a, b = iso.jobs[tenant.name], shared.jobs[tenant.name]
        elapsed += a.wall_s
        same, diff = curves_identical(a, b)
        tenants.append(
            {
                "name": tenant.name,
                "kind": tenant.kind,
                "head": tenant.head["kind"],
                "algorithm": tenant.algorithm or "sft",
                "target": tenant.target,
                "isolated_completion_s": a.wall_s,
                "isolated_finish_s": elapsed,
                "multi_completion_s": b.wall_s,
                "final_metric_name": FINAL_METRIC[tenant.kind],
                "final_metric": b.final_metric(),
                "final_metric_isolated": a.final_metric(),
                "curves_identical": same,
                "curve_max_abs_diff": diff,
                "curves": {"isolated": a.curve, "multi": b.curve},
            }
        )
    result["tenants"] = tenants
    result["time_breakdown"] = {name: breakdown(p) for name, p in phases.items()}
    result["waits"] = {name: waits(p) for name, p in phases.items()}
    return result


def print_table(result: dict[str, Any]) -> None:
    print()
    print(f"{'':<34}{'isolated':>12}{'shared':>12}{'ratio':>10}   paper")
    agg = (result["aggregate_isolated_s"], result["aggregate_multi_s"])
    print(
        f"{'aggregate held time (s)':<34}{agg[0]:>12.1f}{agg[1]:>12.1f}"
        f"{agg[1] / agg[0]:>10.2f}   "
        f"-{result['aggregate_time_reduction']:.1%} vs -28.3%"
    )
    paper = {"train": "20.8% -> 41.3% (1.99x)", "infer": "28.1% -> 37.5% (1.33x)", "env": ""}
    for service in SERVICES:
        iso, multi = result[f"{service}_util_isolated"], result[f"{service}_util_multi"]
        print(
            f"{service + ' utilisation (busy/held)':<34}{iso:>12.1%}{multi:>12.1%}"
            f"{result[f'{service}_util_ratio']:>9.2f}x   {paper[service]}"
        )
    print(f"{'wall time (s)':<34}{result['isolated_wall_s']:>12.1f}{result['multi_wall_s']:>12.1f}")
    inflation = ", ".join(f"{s} {result[f'{s}_busy_inflation']:.2f}x" for s in SERVICES)
    print(
        f"busy seconds of the same work, shared / isolated (contention for the cores): {inflation}"
    )
    print(
        f"the work's own compute, {result['work_compute_s']:.0f} core-seconds, kept "
        f"{result['cores_in_use_isolated']:.2f} of {result['cores']} cores busy on average "
        f"isolated and {result['cores_in_use_multi']:.2f} shared"
    )
    print()
    print(
        f"{'tenant':<15}{'job':<22}{'alone s':>9}{'queued s':>10}{'shared s':>10}"
        f"{'final':>16}{'curves':>14}"
    )
    for t in result["tenants"]:
        what = f"{t['head']}/{t['algorithm']}"
        final = f"{t['final_metric_name']} {t['final_metric']:.3f}"
        same = "identical" if t["curves_identical"] else f"diff {t['curve_max_abs_diff']:.1e}"
        print(
            f"{t['name']:<15}{what:<22}{t['isolated_completion_s']:>9.1f}"
            f"{t['isolated_finish_s']:>10.1f}{t['multi_completion_s']:>10.1f}{final:>16}"
            f"{same:>14}"
        )
    print()
    print("where the time went (seconds; overhead = work in hand but not computing)")
    print(
        f"{'mode':<10}{'service':<8}{'held':>9}{'busy':>9}{'overhead':>10}{'of it commits':>15}"
        f"{'idle':>9}"
    )
    for mode, services in result["time_breakdown"].items():
        for service, b in services.items():
            print(
                f"{mode:<10}{service:<8}{b['held_s']:>9.1f}{b['busy_s']:>9.1f}"
                f"{b['overhead_s']:>10.1f}{b['commit_s']:>15.1f}{b['idle_s']:>9.1f}"
            )
    print()
    print(
        f"{'mode':<10}{'SFT batch wait':>16}{'act round trip':>16}{'in inferencer':>15}"
        f"{'forward':>9}{'obs/forward':>13}   (ms)"
    )
    for mode, w in result["waits"].items():
        print(
            f"{mode:<10}{w['train_batch_wait_ms']:>16.1f}{w['act_round_trip_ms']:>16.1f}"
            f"{w['act_in_inferencer_ms']:>15.1f}{w['act_forward_ms']:>9.1f}"
            f"{w['observations_per_forward']:>13.1f}"
        )


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
        extra_env={"JOYNEXUS_HEARTBEAT_INTERVAL_S": "0.5"},
    )
    try:
        info = stack.start_server()
        stack.start_roles()
        print(f"bus: {info.url}; waiting for the services (model load)", flush=True)
        _, missing = asyncio.run(wait_healthy(info, stack.expected_roles, 180))
        if missing:
            print(f"roles did not come up: {missing}; see {config.home}/logs", file=sys.stderr)
            return 1
        phases, sampler, instances = asyncio.run(run_phases(config, info, data))
    finally:
        stack.stop()
    write_raw(phases, sampler, config.out_dir / "raw.json")
    result = summarise(config, phases)
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
    print(f"\nreport: {report_path}\ncosts (for `joynexus simulate --costs`): {costs_path}")
    if config.json_path:
        config.json_path.parent.mkdir(parents=True, exist_ok=True)
        config.json_path.write_text(json.dumps(result, indent=2))
        print(f"json: {config.json_path}")
    print("demo succeeded")
    return 0


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--home", type=Path, default=Path(".joynexus"))
    scenario.add_arguments(p)
    args = p.parse_args(argv)
    return run(config_of(args, args.home))


if __name__ == "__main__":
    raise SystemExit(main())
