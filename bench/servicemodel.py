"""The discrete-event model behind ``joynexus simulate`` (:mod:`bench.simulate`): the
services, queues and policies of a JoyNexus stack at the level of whole operations.

* **RL** (as :mod:`services.envs.rollouts` runs it): an iteration's episodes are split into
  rollout tasks of ``parallel_envs`` sessions; an env worker takes a task (the one with
  fewest tasks in hand), resets its sessions, then steps them in lockstep: per step one act
  request with every live session's observation goes to INFER, and on the answer each
  session executes its action chunk. The rollouts go to TRAIN; once all episodes of the
  iteration are in, the trainer's next round runs the update, the new version is committed,
  and the next iteration's tasks go out (staleness bound ``max_policy_lag`` = 0).
* **Inference**: the (B, T) scheduler groups the requests of all tenants, a batch when its
  observations reach ``max_batch`` or its oldest request has waited ``max_wait_s``; one
  forward per batch, any free inferencer.
* **Training**: a trainer's round takes one batch of every running SFT tenant placed on it
  (the dataset stream runs ahead) into one grouped step, then the RL updates that are
  ready; SFT commits are written in the background. Tenants are placed on the least loaded
  trainer.

Costs are per operation, linear in the work where the work varies (``fixed + per_unit * n``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import msgspec

SERVICES = ("train", "infer", "env")
#: Rollout and evaluation tasks an env worker runs at once (services.envs' concurrency).
ENV_WORKER_TASKS = 8


class Costs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds per operation."""

    #: A grouped SFT step's compute: fixed, and per sample of the round's batches.
    sft_step_s: float = 0.01
    sft_per_sample_s: float = 0.002
    #: Per round with SFT batches: fetching, decoding, normalising, settling (the trainer
    #: is occupied, not computing).
    sft_round_overhead_s: float = 0.003
    #: An RL update's compute: fixed, and per episode step of the iteration.
    rl_update_s: float = 0.02
    rl_per_sample_s: float = 0.002
    #: Committing a policy version (checkpoint, KV, event). Off the trainer's critical path;
    #: an RL tenant's next iteration waits for it.
    commit_s: float = 0.02
    #: An inference batch's forward: fixed, and per observation.
    act_batch_s: float = 0.006
    act_per_sample_s: float = 0.0015
    #: A simulator step and reset (a tenant's own measured values take precedence).
    env_step_s: float = 0.02
    #: How much a lockstep call's time varies (coefficient of variation): each call's time
    #: is drawn around its mean with it, so parallel tasks drift apart as real ones do.
    env_step_cv: float = 0.0
    reset_s: float = 0.02
    #: Per lockstep step of a rollout task, what is neither simulating nor waiting for the
    #: act answer: observations to messages, the records at the end (worker occupied).
    env_step_overhead_s: float = 0.005
    #: One message hop (publish → delivered): in flight, nobody busy.
    hop_s: float = 0.002
    #: Submit → the initial version committed; final version → the job's end.
    job_start_s: float = 0.05
    job_end_s: float = 0.01


class TenantLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tenant's job, in the units the simulator counts."""

    name: str
    kind: Literal["rl", "sft"]
    #: RL: updates (= policy versions after the initial one); SFT: optimizer steps.
    iterations: int
    #: SFT: samples per step.
    batch_size: int = 8
    checkpoint_every: int = 10
    #: RL: episodes per iteration, run as tasks of ``parallel_envs`` sessions in lockstep.
    episodes_per_iteration: int = 4
    parallel_envs: int = 4
    #: RL: env steps per episode (the mean measured, or the limit).
    episode_steps: float = 20.0
    #: Env steps per act request (the head's action chunk, executed open-loop).
    chunk_len: int = 1
    #: This tenant's env costs (None: the costs' defaults).
    env_step_s: float | None = None
    env_step_cv: float | None = None
    reset_s: float | None = None
    env_step_overhead_s: float | None = None

    @property
    def lockstep_steps(self) -> int:
        """Act requests per rollout task: one per chunk of env steps."""
        return max(1, math.ceil(self.episode_steps / self.chunk_len))

    @property
    def samples(self) -> float:
        """Samples the trainer steps over for the whole job (RL: one per act)."""
        if self.kind == "sft":
            return float(self.iterations * self.batch_size)
        return float(self.iterations * self.episodes_per_iteration * self.lockstep_steps)


class Topology(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Instances of each service (one per accelerator in the paper's setting)."""

    train: int = 1
    infer: int = 1
    env: int = 1
    #: Inference scheduler: target batch (observations) and max wait (seconds).
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


@dataclass
class _Union:
    """Busy time of one instance whose work can overlap (an env worker's threads): the
    union of its intervals."""

    active: int = 0
    since: float = 0.0
    total: float = 0.0

    def start(self, now: float) -> None:
        if self.active == 0:
            self.since = now
        self.active += 1

    def stop(self, now: float) -> None:
        self.active -= 1
        if self.active == 0:
            self.total += now - self.since


@dataclass
class _Request:
    at: float
    observations: int
    reply: Callable[[], None]


@dataclass
class _Trainer:
    tenants: list[str] = field(default_factory=list)
    busy: bool = False
    #: RL updates ready: (samples, then).
    updates: deque[tuple[float, Callable[[], None]]] = field(default_factory=deque)


class Simulation:
    """One run: ``tenants`` all submitted at time 0 on ``topology``."""

    def __init__(
        self,
        costs: Costs,
        topology: Topology,
        tenants: Sequence[TenantLoad],
        *,
        max_events: int = 50_000_000,
        seed: int = 0,
    ) -> None:
        self.costs = costs
        #: Draws the variation of simulator calls (seeded: a run is reproducible).
        self.rng = random.Random(seed)
        self.topo = topology
        self.tenants = list(tenants)
        self.max_events = max_events
        self.now = 0.0
        self._heap: list[_Event] = []
        self._seq = itertools.count()
        self.events = 0
        self.stats = {s: ServiceStats() for s in SERVICES}
        self.completion: dict[str, float] = {}
        self.infer_free = topology.infer
        self.infer_queue: deque[_Request] = deque()
        self.infer_obs = 0
        self.infer_timer_at = -1.0
        self.env_tasks = [0] * topology.env
        self.env_union = [_Union() for _ in range(topology.env)]
        self.env_waiting: deque[Callable[[int], None]] = deque()
        self.trainers = [_Trainer() for _ in range(topology.train)]
        self.trainer_of: dict[str, int] = {}
        #: SFT tenants' steps still to take, by tenant name.
        self.sft_left: dict[str, int] = {}
        self.sft_loads: dict[str, TenantLoad] = {}

    # -- the event loop ------------------------------------------------------------------

    def at(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, _Event(self.now + delay, next(self._seq), action))

    def run(self) -> RunResult:
        load = [0.0] * self.topo.train
        for tenant in sorted(self.tenants, key=lambda t: -t.samples):
            trainer = load.index(min(load))  # placement balances the work
            load[trainer] += tenant.samples
            self.trainer_of[tenant.name] = trainer
            self.trainers[trainer].tenants.append(tenant.name)
        for tenant in self.tenants:
            if tenant.kind == "rl":
                self.at(self.costs.job_start_s, partial(self.start_iteration, tenant, 0))
            else:
                self.at(self.costs.job_start_s, partial(self.start_sft, tenant))
        while self._heap:
            self.events += 1
            if self.events > self.max_events:
                raise RuntimeError(f"simulation exceeded {self.max_events} events")
            event = heapq.heappop(self._heap)
            self.now = event.at
            event.action()
        makespan = self.now
        self.stats["env"].busy_s = sum(u.total for u in self.env_union)
        for service, stats in self.stats.items():
            stats.held_s = makespan * self.topo.count(service)
        return RunResult(makespan, self.stats, self.completion, self.events)

    def finish(self, tenant: TenantLoad) -> None:
        self.at(self.costs.job_end_s, lambda: self.completion.__setitem__(tenant.name, self.now))

    # -- RL: iterations of rollout tasks ---------------------------------------------------

    def start_iteration(self, tenant: TenantLoad, iteration: int) -> None:
        tasks = math.ceil(tenant.episodes_per_iteration / tenant.parallel_envs)
        left = [tasks]

        def task_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.at(self.costs.hop_s, lambda: self.rollouts_in(tenant, iteration))

        for first in range(0, tenant.episodes_per_iteration, tenant.parallel_envs):
            sessions = min(tenant.parallel_envs, tenant.episodes_per_iteration - first)
            start = partial(self.run_task, tenant, sessions=sessions, done=task_done)
            self.at(self.costs.hop_s, partial(self.take_task, start))

    def take_task(self, start: Callable[[int], None]) -> None:
        """The env worker with fewest tasks in hand takes it (or it waits for one)."""
        worker = min(range(self.topo.env), key=lambda w: (self.env_tasks[w], w))
        if self.env_tasks[worker] >= ENV_WORKER_TASKS:
            self.env_waiting.append(start)
            return
        self.env_tasks[worker] += 1
        start(worker)

    def simulate(self, worker: int, seconds: float, then: Callable[[], None]) -> None:
        """A simulator call on ``worker`` (its own thread: calls of its tasks overlap)."""
        self.env_union[worker].start(self.now)
        self.stats["env"].ops += 1

        def done() -> None:
            self.env_union[worker].stop(self.now)
            then()

        self.at(seconds, done)

    def run_task(
        self, tenant: TenantLoad, worker: int, *, sessions: int, done: Callable[[], None]
    ) -> None:
        c = self.costs
        step_s = c.env_step_s if tenant.env_step_s is None else tenant.env_step_s
        reset_s = c.reset_s if tenant.reset_s is None else tenant.reset_s
        overhead_s = (
            c.env_step_overhead_s
            if tenant.env_step_overhead_s is None
            else tenant.env_step_overhead_s
        )
        steps = tenant.lockstep_steps
        chunk_s = sessions * tenant.chunk_len * step_s
        cv = c.env_step_cv if tenant.env_step_cv is None else tenant.env_step_cv

        def lockstep(k: int) -> None:
            if k == steps:
                self.env_tasks[worker] -= 1
                if self.env_waiting:
                    self.take_task(self.env_waiting.popleft())
                done()
                return

            def answered() -> None:
                self.simulate(worker, chunk_s * self.vary(cv), lambda: lockstep(k + 1))

            self.at(overhead_s + c.hop_s, lambda: self.request_act(sessions, answered))

        self.simulate(worker, sessions * reset_s, lambda: lockstep(0))

    def vary(self, cv: float) -> float:
        """A factor of mean 1 and coefficient of variation ``cv`` (gamma-distributed)."""
        if cv <= 0:
            return 1.0
        shape = 1.0 / (cv * cv)
        return self.rng.gammavariate(shape, 1.0 / shape)

    def rollouts_in(self, tenant: TenantLoad, iteration: int) -> None:
        samples = tenant.episodes_per_iteration * tenant.lockstep_steps

        def updated() -> None:
            def committed() -> None:
                if iteration + 1 == tenant.iterations:
                    self.finish(tenant)
                else:
                    self.start_iteration(tenant, iteration + 1)

            self.at(self.costs.commit_s + self.costs.hop_s, committed)

        trainer = self.trainers[self.trainer_of[tenant.name]]
        trainer.updates.append((samples, updated))
        self.train_round(self.trainer_of[tenant.name])

    # -- inference: the (B, T) scheduler -------------------------------------------------

    def request_act(self, observations: int, answered: Callable[[], None]) -> None:
        self.infer_queue.append(_Request(self.now, observations, answered))
        self.infer_obs += observations
        self.dispatch_infer()

    def dispatch_infer(self) -> None:
        while self.infer_free and self.infer_queue:
            oldest = self.infer_queue[0].at
            waited = self.now - oldest
            if self.infer_obs < self.topo.max_batch and waited < self.topo.max_wait_s - 1e-12:
                due = oldest + self.topo.max_wait_s
                if self.infer_timer_at < self.now or due < self.infer_timer_at:
                    self.infer_timer_at = due
                    self.at(due - self.now, self.dispatch_infer)
                return
            batch = [self.infer_queue.popleft()]
            obs = batch[0].observations
            while (
                self.infer_queue and obs + self.infer_queue[0].observations <= self.topo.max_batch
            ):
                obs += self.infer_queue[0].observations
                batch.append(self.infer_queue.popleft())
            self.infer_obs -= obs
            cost = self.costs.act_batch_s + self.costs.act_per_sample_s * obs
            self.infer_free -= 1
            self.stats["infer"].busy_s += cost
            self.stats["infer"].ops += 1

            def forwarded(batch: list[_Request] = batch) -> None:
                self.infer_free += 1
                for request in batch:
                    self.at(self.costs.hop_s, request.reply)
                self.dispatch_infer()

            self.at(cost, forwarded)

    # -- SFT: steps in the trainer's rounds ----------------------------------------------

    def start_sft(self, tenant: TenantLoad) -> None:
        self.sft_left[tenant.name] = tenant.iterations
        self.sft_loads[tenant.name] = tenant
        self.train_round(self.trainer_of[tenant.name])

    # -- the trainer's rounds ------------------------------------------------------------

    def train_round(self, index: int) -> None:
        """A round: one batch of every running SFT tenant on this trainer (one grouped step),
        then the RL updates that are ready."""
        trainer = self.trainers[index]
        if trainer.busy:
            return
        sft = [n for n in trainer.tenants if self.sft_left.get(n, 0) > 0]
        updates = list(trainer.updates)
        trainer.updates.clear()
        if not sft and not updates:
            return
        c = self.costs
        busy = 0.0
        occupied = 0.0
        if sft:
            batch = sum(self.sft_loads[n].batch_size for n in sft)
            busy += c.sft_step_s + c.sft_per_sample_s * batch
            occupied += c.sft_round_overhead_s
        for samples, _ in updates:
            busy += c.rl_update_s + c.rl_per_sample_s * samples
        trainer.busy = True
        self.stats["train"].busy_s += busy
        self.stats["train"].ops += 1

        def done() -> None:
            trainer.busy = False
            for name in sft:
                self.sft_left[name] -= 1
                if self.sft_left[name] == 0:  # its final version, then its end
                    self.at(c.commit_s, partial(self.finish, self.sft_loads[name]))
            for _, then in updates:
                then()
            self.train_round(index)

        self.at(busy + occupied, done)
