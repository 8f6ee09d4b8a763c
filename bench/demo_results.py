"""The demo's results: what one tenant's job and one phase measured, and what is made of
them (the summary the JSON holds, the per-service breakdown, the waits, the printed table).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from bench import scenario
from bench.gauges import SERVICES
from bench.scenario import DemoConfig, DemoTenant
from bus.usage import Bill

#: The per-iteration (RL) or per-step (SFT) metrics compared between the two phases.
CURVE_METRICS = {"rl": ("return_mean", "policy_loss", "episode_length"), "sft": ("loss",)}
#: What each kind's final metric is (the mean of the last ``FINAL_WINDOW`` values for SFT).
FINAL_METRIC = {"rl": "return_mean", "sft": "loss"}
FINAL_WINDOW = 10


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


def tenant_bills(bill: Bill, phases: dict[str, PhaseRun]) -> list[dict[str, Any]]:
    """Each tenant's compute seconds per service, as the services charged them
    (:mod:`bus.usage`), for its job alone and for its job shared."""
    rows = []
    for name, alone in phases["isolated"].jobs.items():
        jobs = bill.jobs_of(name)
        row: dict[str, Any] = {"tenant": name}
        for label, trace in (("alone", alone), ("shared", phases["shared"].jobs[name])):
            row[label] = {s: c.compute_s for s, c in jobs.get(trace.job_id, {}).items()}
        rows.append(row)
    return rows


def print_bills(rows: list[dict[str, Any]]) -> None:
    print()
    print("compute charged to each tenant's job (joynexus usage --by-job), seconds alone / shared")
    print(f"{'tenant':<15}{'trainer':>16}{'inferencer':>16}{'envs':>16}{'total':>16}")
    for row in rows:
        cells = []
        for service in ("trainer", "inferencer", "envs"):
            alone, shared = row["alone"].get(service, 0.0), row["shared"].get(service, 0.0)
            cells.append(f"{alone:>7.2f} /{shared:>6.2f}")
        total = (sum(row["alone"].values()), sum(row["shared"].values()))
        cells.append(f"{total[0]:>7.2f} /{total[1]:>6.2f}")
        print(f"{row['tenant']:<15}" + "".join(f"{c:>16}" for c in cells))
    print(
        "(the seconds each service measured, split by each job's share of the work it shared; "
        "where the roles contend for few cores the same work takes longer shared)"
    )
