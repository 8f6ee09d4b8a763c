"""``joynexus simulate``: a discrete-event model of JoyNexus's services and queues.

The model (:mod:`bench.servicemodel`) has the same shape as the real stack, operation by
operation: rollout tasks in lockstep with one act request per step, the (B, T) inference
scheduler, the trainer's rounds, commits, bus hops. Costs are per operation, linear in the
work where the work varies (``fixed + per_unit * n``), measured by ``joynexus demo`` (its
costs file holds each phase's) or supplied by a user. Two
modes, as in the paper: *isolated* (each tenant alone, one after another, holding its own set
of services) and *shared* (all at once on one set). For both it reports aggregate held time
(the sum over services of time held), per-service utilisation (busy / held) and per-tenant
completion, and names the first bottleneck (the most utilised service) at each scale.

```
joynexus simulate --costs .joynexus/demo/costs.json --train 2 --infer 2 --env 4 \\
    --tenants 10,100,1000
```
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.servicemodel import (
    SERVICES,
    Costs,
    RunResult,
    ServiceStats,
    Simulation,
    TenantLoad,
    Topology,
)

# -- the two modes and the report ------------------------------------------------------


@dataclass
class Comparison:
    isolated: RunResult
    shared: RunResult
    isolated_completion_s: dict[str, float]

    @property
    def aggregate_time_reduction(self) -> float:
        return 1.0 - self.shared.aggregate_s / self.isolated.aggregate_s

    def utilisation(self, mode: str, service: str) -> float:
        run = self.isolated if mode == "isolated" else self.shared
        return run.services[service].utilisation

    def bottleneck(self) -> str:
        """The most utilised service type when shared: the first to saturate as load grows."""
        return max(SERVICES, key=lambda s: self.shared.services[s].utilisation)


def isolated(costs: Costs, topology: Topology, tenants: Sequence[TenantLoad]) -> RunResult:
    """Each tenant alone, one after another, on ``topology`` (held for its whole run)."""
    services = {s: ServiceStats() for s in SERVICES}
    completion: dict[str, float] = {}
    total = 0.0
    events = 0
    for tenant in tenants:
        alone = Simulation(costs, topology, [tenant]).run()
        for s in SERVICES:
            services[s].busy_s += alone.services[s].busy_s
            services[s].held_s += alone.services[s].held_s
            services[s].ops += alone.services[s].ops
        completion[tenant.name] = alone.completion_s[tenant.name]
        total += alone.makespan_s
        events += alone.events
    return RunResult(total, services, completion, events)


def compare(costs: Costs, topology: Topology, tenants: Sequence[TenantLoad]) -> Comparison:
    """The isolated and the shared mode of ``tenants`` on ``topology``."""
    alone = isolated(costs, topology, tenants)
    # "Completion" in isolated mode counts the wait for the tenants before it, as a
    # tenant queued behind others experiences it.
    queued, elapsed = {}, 0.0
    for tenant in tenants:
        elapsed += alone.completion_s[tenant.name]
        queued[tenant.name] = elapsed
    shared = Simulation(costs, topology, tenants).run()
    return Comparison(alone, shared, queued)


def summary(cmp: Comparison) -> dict[str, float | str]:
    return {
        "aggregate_isolated_s": cmp.isolated.aggregate_s,
        "aggregate_multi_s": cmp.shared.aggregate_s,
        "aggregate_time_reduction": cmp.aggregate_time_reduction,
        "train_util_isolated": cmp.utilisation("isolated", "train"),
        "train_util_multi": cmp.utilisation("shared", "train"),
        "infer_util_isolated": cmp.utilisation("isolated", "infer"),
        "infer_util_multi": cmp.utilisation("shared", "infer"),
        "env_util_isolated": cmp.utilisation("isolated", "env"),
        "env_util_multi": cmp.utilisation("shared", "env"),
        "makespan_multi_s": cmp.shared.makespan_s,
        "bottleneck": cmp.bottleneck(),
    }


def paper_mix(count: int, scenario: Sequence[TenantLoad] = ()) -> list[TenantLoad]:
    """``count`` tenants in the demo's proportions (three RL tenants to one SFT tenant):
    copies of ``scenario``'s tenants in turn (default: a generic 3 + 1 mix)."""
    base = list(scenario) or [
        TenantLoad("rl-a", "rl", 3),
        TenantLoad("rl-b", "rl", 3),
        TenantLoad("rl-c", "rl", 3),
        TenantLoad("sft", "sft", 30, batch_size=8),
    ]
    return [
        msgspec.structs.replace(base[i % len(base)], name=f"t{i}-{base[i % len(base)].name}")
        for i in range(count)
    ]


class CostsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Measured (or supplied) costs, the topology they were measured on and the workload."""

    costs: Costs
    topology: Topology = Topology()
    tenants: list[TenantLoad] = []


class DemoCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``joynexus demo`` writes: the costs of each of its phases. The isolated phase's
    are each service's own (one tenant's work at a time); the shared phase's include the
    contention of all tenants' work for this machine's cores."""

    isolated: CostsFile
    shared: CostsFile


def load_costs(path: Path) -> CostsFile:
    """A costs file: the demo's (its isolated phase's costs) or a user's :class:`CostsFile`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SystemExit(f"simulate: {path}: {exc}") from exc
    try:
        return msgspec.json.decode(data, type=DemoCosts).isolated
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    try:
        return msgspec.json.decode(data, type=CostsFile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise SystemExit(f"simulate: {path}: {exc}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="joynexus simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", type=Path, help="costs file written by `joynexus demo`")
    p.add_argument("--train", type=int, default=2, help="training service instances")
    p.add_argument("--infer", type=int, default=2, help="inference service instances")
    p.add_argument("--env", type=int, default=4, help="env worker instances")
    p.add_argument(
        "--tenants", default="4,10,100,1000", help="comma-separated tenant counts to project"
    )
    p.add_argument("--json", type=Path, help="write the projections here")
    args = p.parse_args(argv)
    loaded = load_costs(args.costs) if args.costs else CostsFile(Costs())
    topology = msgspec.structs.replace(
        loaded.topology, train=args.train, infer=args.infer, env=args.env
    )
    rows = []
    print(
        f"{'tenants':>8}{'agg. reduction':>16}{'train util':>20}{'infer util':>20}"
        f"{'env util':>20}{'bottleneck':>12}"
    )
    for count in (int(c) for c in args.tenants.split(",")):
        cmp = compare(loaded.costs, topology, paper_mix(count, loaded.tenants))
        rows.append({"tenants": count, **summary(cmp)})
        utils = "".join(
            f"{cmp.utilisation('isolated', s):>10.1%} →{cmp.utilisation('shared', s):>7.1%}"
            for s in SERVICES
        )
        print(f"{count:>8}{cmp.aggregate_time_reduction:>16.1%}{utils}{cmp.bottleneck():>12}")
    if args.json:
        args.json.write_text(json.dumps({"topology": msgspec.to_builtins(topology), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
