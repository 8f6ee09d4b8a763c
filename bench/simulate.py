"""``joynexus simulate``: a discrete-event model of JoyNexus's services and queues.

The same shape as the real stack, at the level of whole operations: env workers pull episode
tasks from ENV (FIFO over tenants); every env step sends an act request to INFER, whose
scheduler batches requests of all tenants (target batch ``B`` or max wait ``T``, whichever
first) into one forward; a finished iteration's rollouts go to TRAIN, where the trainer's
round takes one work item of every tenant that has one (deficit round robin with equal
quanta) into one grouped step, then commits a policy version; an RL tenant's next iteration
waits for that version (staleness bound ``max_policy_lag`` = 0, as in the demo).

Costs are per operation and linear in the group size (``fixed + per_sample * n``), measured
by ``joynexus demo`` (its costs file) or supplied by a user. Two modes, as in the paper:
*isolated* (each tenant alone, one after another, on its own held set of services) and
*shared* (all tenants at once on one set). For both it reports aggregate held time (the sum
over services of time held), per-service utilisation (busy / held) and per-tenant completion,
and names the first bottleneck (the most utilised service type) at each scale.

```
joynexus simulate --costs costs.json --train 2 --infer 2 --env 4 --tenants 10,100,1000
```
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

SERVICES = ("train", "infer", "env")


class Costs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds per operation. A trainer round over samples of ``k`` tenants costs
    ``train_round_s + train_per_sample_s * samples + train_per_tenant_s * k``."""

    train_round_s: float = 0.002
    #: Grouped backbone forward + head forward/backward, per sample.
    train_per_sample_s: float = 0.002
    #: Per tenant in a round: its head's optimizer step and bookkeeping.
    train_per_tenant_s: float = 0.004
    #: Committing one policy version (checkpoint + KV), trainer busy.
    commit_s: float = 0.02
    act_batch_s: float = 0.004
    act_per_sample_s: float = 0.001
    env_step_s: float = 0.002
    #: One message hop (publish → delivered); time in flight, nobody busy.
    hop_s: float = 0.001


class TenantLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tenant's job, in the units the simulator counts."""

    name: str
    kind: Literal["rl", "sft"]
    #: RL: updates (= policy versions); SFT: optimizer steps.
    iterations: int
    #: SFT: samples per step. RL: unused.
    batch_size: int = 8
    episodes_per_iteration: int = 4
    episode_steps: int = 20
    #: RL: passes over an iteration's samples in its update.
    update_epochs: int = 1
    #: SFT: a version every this many steps (and at the last).
    checkpoint_every: int = 10

    @property
    def samples(self) -> int:
        """Samples the trainer steps over for the whole job."""
        if self.kind == "sft":
            return self.iterations * self.batch_size
        per_iteration = self.episodes_per_iteration * self.episode_steps * self.update_epochs
        return self.iterations * per_iteration


class Topology(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Instances of each service (one per accelerator in the paper's setting)."""

    train: int = 1
    infer: int = 1
    env: int = 1
    #: Episodes an env worker runs at once (their env steps share its one core).
    env_sessions: int = 4
    #: Inference scheduler: target batch and max wait (seconds).
    max_batch: int = 16
    max_wait_s: float = 0.005

    def count(self, service: str) -> int:
        return int(getattr(self, service))


@dataclass
class ServiceStats:
    busy_s: float = 0.0
    held_s: float = 0.0
    ops: int = 0

    @property
    def utilisation(self) -> float:
        return self.busy_s / self.held_s if self.held_s else 0.0


@dataclass
class RunResult:
    makespan_s: float
    services: dict[str, ServiceStats]
    completion_s: dict[str, float]
    events: int

    @property
    def aggregate_s(self) -> float:
        return sum(s.held_s for s in self.services.values())


@dataclass(order=True)
class _Event:
    at: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class Simulation:
    """One run: ``tenants`` start at time 0 on ``topology``."""

    def __init__(
        self,
        costs: Costs,
        topology: Topology,
        tenants: Sequence[TenantLoad],
        *,
        max_events: int = 20_000_000,
    ) -> None:
        self.costs = costs
        self.topo = topology
        self.tenants = list(tenants)
        self.max_events = max_events
        self.now = 0.0
        self._heap: list[_Event] = []
        self._seq = itertools.count()
        self.stats = {s: ServiceStats() for s in SERVICES}
        self.completion: dict[str, float] = {}
        self.free = {s: topology.count(s) for s in SERVICES}
        self.env_queue: deque[tuple[TenantLoad, int]] = deque()
        self.free_sessions = topology.env * topology.env_sessions
        self.env_steps: deque[Callable[[], None]] = deque()
        self.infer_queue: deque[tuple[float, Callable[[], None]]] = deque()
        self.infer_timer_armed = False
        #: Per tenant, the work items the trainer may take, in order.
        self.train_queues: dict[str, deque[_TrainItem]] = {}
        #: Placement: tenant ``i`` is served by trainer ``i % train`` (its slot lives there),
        #: each trainer running rounds over its own tenants.
        self.train_order: list[deque[str]] = [deque() for _ in range(topology.train)]
        self.trainer_of: dict[str, int] = {}
        self.trainer_busy = [False] * topology.train
        self.episodes_left: dict[str, int] = {}
        self.events = 0

    # -- the event loop ------------------------------------------------------------------

    def at(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, _Event(self.now + delay, next(self._seq), action))

    def run(self) -> RunResult:
        load = [0.0] * self.topo.train
        for tenant in sorted(self.tenants, key=lambda t: -t.samples):
            trainer = load.index(min(load))  # the least loaded: placement balances work
            load[trainer] += tenant.samples
            self.train_queues[tenant.name] = deque()
            self.trainer_of[tenant.name] = trainer
            self.train_order[trainer].append(tenant.name)
        for tenant in self.tenants:
            if tenant.kind == "rl":
                self.start_iteration(tenant, 0)
            else:
                self.sft_step(tenant, 0)
        while self._heap:
            self.events += 1
            if self.events > self.max_events:
                raise RuntimeError(f"simulation exceeded {self.max_events} events")
            event = heapq.heappop(self._heap)
            self.now = event.at
            event.action()
        makespan = self.now
        for service, stats in self.stats.items():
            stats.held_s = makespan * self.topo.count(service)
        return RunResult(makespan, self.stats, self.completion, self.events)

    def busy(self, service: str, seconds: float, then: Callable[[], None]) -> None:
        """Occupy one free instance of ``service`` for ``seconds``, then call ``then``."""
        self.free[service] -= 1
        assert self.free[service] >= 0
        self.stats[service].busy_s += seconds
        self.stats[service].ops += 1

        def done() -> None:
            self.free[service] += 1
            then()
            self.dispatch()

        self.at(seconds, done)

    def dispatch(self) -> None:
        """Give free instances work, as the real consumers pull it."""
        while self.free_sessions and self.env_queue:
            tenant, iteration = self.env_queue.popleft()
            self.free_sessions -= 1
            self.run_episode(tenant, iteration, step=0)
        while self.free["env"] and self.env_steps:
            self.busy("env", self.costs.env_step_s, self.env_steps.popleft())
        self.dispatch_infer()
        for trainer, order in enumerate(self.train_order):
            if not self.trainer_busy[trainer] and any(self.train_queues[n] for n in order):
                self.train_round(trainer)

    # -- RL: iterations of episodes, act requests, updates -----------------------------

    def start_iteration(self, tenant: TenantLoad, iteration: int) -> None:
        self.episodes_left[tenant.name] = tenant.episodes_per_iteration
        for _ in range(tenant.episodes_per_iteration):
            self.env_queue.append((tenant, iteration))
        self.at(self.costs.hop_s, self.dispatch)

    def run_episode(self, tenant: TenantLoad, iteration: int, step: int) -> None:
        """One session (already taken) steps its episode: act request, then env step."""
        if step == tenant.episode_steps:
            self.free_sessions += 1
            self.episode_done(tenant, iteration)
            self.dispatch()
            return

        def acted() -> None:
            self.env_steps.append(lambda: self.run_episode(tenant, iteration, step + 1))
            self.dispatch()

        self.at(self.costs.hop_s, lambda: self.request_act(acted))

    def request_act(self, reply: Callable[[], None]) -> None:
        self.infer_queue.append((self.now, reply))
        self.dispatch_infer()

    def dispatch_infer(self) -> None:
        """The B/T scheduler: a full batch goes at once; a partial one when its oldest
        request has waited ``max_wait_s``."""
        while self.free["infer"] and self.infer_queue:
            oldest = self.infer_queue[0][0]
            if len(self.infer_queue) < self.topo.max_batch and (
                self.now - oldest < self.topo.max_wait_s - 1e-12
            ):
                if not self.infer_timer_armed:
                    self.infer_timer_armed = True
                    self.at(oldest + self.topo.max_wait_s - self.now, self._infer_timer)
                return
            n = min(len(self.infer_queue), self.topo.max_batch)
            batch = [self.infer_queue.popleft()[1] for _ in range(n)]
            cost = self.costs.act_batch_s + self.costs.act_per_sample_s * n

            def answered(batch: list[Callable[[], None]] = batch) -> None:
                for reply in batch:
                    self.at(self.costs.hop_s, reply)

            self.busy("infer", cost, answered)

    def _infer_timer(self) -> None:
        self.infer_timer_armed = False
        self.dispatch_infer()

    def episode_done(self, tenant: TenantLoad, iteration: int) -> None:
        self.episodes_left[tenant.name] -= 1
        if self.episodes_left[tenant.name]:
            return
        samples = tenant.episodes_per_iteration * tenant.episode_steps * tenant.update_epochs

        def updated() -> None:
            if iteration + 1 == tenant.iterations:
                self.completion[tenant.name] = self.now
            else:
                self.at(self.costs.hop_s, lambda: self.start_iteration(tenant, iteration + 1))

        self.at(self.costs.hop_s, lambda: self.enqueue_train(tenant, samples, True, updated))

    # -- SFT: a stream of batches ------------------------------------------------------

    def sft_step(self, tenant: TenantLoad, step: int) -> None:
        last = step + 1 == tenant.iterations
        commit = last or (step + 1) % tenant.checkpoint_every == 0

        def stepped() -> None:
            if last:
                self.completion[tenant.name] = self.now
            else:
                self.sft_step(tenant, step + 1)

        # The dataset stream runs ahead of the trainer, so the next batch is already queued.
        self.enqueue_train(tenant, tenant.batch_size, commit, stepped)

    # -- the trainer: DRR rounds over tenants with work ----------------------------------

    def enqueue_train(
        self, tenant: TenantLoad, samples: int, commit: bool, then: Callable[[], None]
    ) -> None:
        self.train_queues[tenant.name].append(_TrainItem(samples, commit, then))
        self.dispatch()

    def train_round(self, trainer: int) -> None:
        """One round: an item of every tenant with work, one grouped step, then the commits
        of those that end a version (inside the round, as the trainer commits before it
        acks)."""
        items = []
        order = self.train_order[trainer]
        for _ in range(len(order)):
            name = order[0]
            order.rotate(-1)
            if self.train_queues[name]:
                items.append(self.train_queues[name].popleft())
        c = self.costs
        cost = (
            c.train_round_s
            + c.train_per_sample_s * sum(item.samples for item in items)
            + c.train_per_tenant_s * len(items)
            + c.commit_s * sum(item.commit for item in items)
        )

        self.trainer_busy[trainer] = True
        self.stats["train"].busy_s += cost
        self.stats["train"].ops += 1

        def done() -> None:
            self.trainer_busy[trainer] = False
            for item in items:
                item.then()
            self.dispatch()

        self.at(cost, done)


@dataclass(frozen=True)
class _TrainItem:
    samples: int
    commit: bool
    then: Callable[[], None]


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


def compare(costs: Costs, topology: Topology, tenants: Sequence[TenantLoad]) -> Comparison:
    """Each tenant alone, one after another, on ``topology`` (held for its whole run), and
    all of them at once on one ``topology``."""
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
    isolated = RunResult(total, services, completion, events)
    # "Completion" in isolated mode counts the wait for the tenants before it, as a
    # tenant queued behind others experiences it.
    isolated_completion, elapsed = {}, 0.0
    for tenant in tenants:
        elapsed += completion[tenant.name]
        isolated_completion[tenant.name] = elapsed
    shared = Simulation(costs, topology, tenants).run()
    return Comparison(isolated, shared, isolated_completion)


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


def paper_mix(count: int, rl_iterations: int = 3, sft_steps: int = 30) -> list[TenantLoad]:
    """``count`` tenants in the demo's proportions: three RL tenants to one SFT tenant."""
    tenants = []
    for i in range(count):
        if i % 4 == 3:
            tenants.append(TenantLoad(f"t{i}", "sft", sft_steps, batch_size=8))
        else:
            tenants.append(TenantLoad(f"t{i}", "rl", rl_iterations))
    return tenants


class CostsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``joynexus demo`` writes for the simulator: measured costs and its workload."""

    costs: Costs
    topology: Topology = Topology()
    tenants: list[TenantLoad] = []


def load_costs(path: Path) -> CostsFile:
    try:
        return msgspec.json.decode(path.read_bytes(), type=CostsFile)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
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
    base = loaded.topology
    topology = msgspec.structs.replace(base, train=args.train, infer=args.infer, env=args.env)
    rows = []
    print(
        f"{'tenants':>8}{'agg. reduction':>16}{'train util':>20}{'infer util':>20}"
        f"{'bottleneck':>12}"
    )
    for count in (int(c) for c in args.tenants.split(",")):
        cmp = compare(loaded.costs, topology, paper_mix(count))
        row = {"tenants": count, **summary(cmp)}
        rows.append(row)
        utils = "".join(
            f"{cmp.utilisation('isolated', s):>10.1%} →{cmp.utilisation('shared', s):>7.1%}"
            for s in ("train", "infer")
        )
        print(f"{count:>8}{cmp.aggregate_time_reduction:>16.1%}{utils}{cmp.bottleneck():>12}")
    if args.json:
        args.json.write_text(json.dumps({"topology": msgspec.to_builtins(topology), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
