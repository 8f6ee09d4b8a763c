"""``joynexus bench flood``: does one tenant's flood slow down or break another tenant?

One local stack (embedded NATS with per-tenant identities, master, trainer, inferencer, one
env worker), two registered tenants, each acting with its own credentials:

* **calm** runs the same SFT job (same spec and seed, a new job id) in every phase and, while
  it trains, asks its policy from a warm-up job for actions in a closed loop (one request
  after the other, as a robot controller would);
* **flood**, from its own process, sends as many requests at once as the master answers of
  one tenant (16 loops, each sending again as soon as it is answered), one kind per phase:
  nothing (``none``); garbage bytes on its request subjects (``garbage``); a low-level
  session's ``forward_backward`` calls with actions of the wrong shape or NaN
  (``bad-call``); act requests with an oversize image (520 px, ~0.8 MB) or NaN proprio
  (``bad-act``); valid act requests on its own session's policy (``act``).

Reported per phase: the calm tenant's SFT samples/s and act replies/s, each as a ratio to
the mean of the two ``none`` phases (the first and the last, so drift of a shared machine's
load is averaged out); what the flood was answered (error codes, per kind); and the checks
that matter more than the ratios: every calm job succeeded with the same per-step losses
as in the first phase, no dead letter is the calm tenant's, every flood request got an
answer, and no role process died.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bus.codec import decode
from bus.datasets import register_path
from bus.identity import OPERATOR_NAME
from bus.inference import observation
from bus.local import StackInfo
from clients.calls import CallError
from clients.errors import RequestError
from clients.lowlevel import AdamParams, ServiceClient, TrainingClient, VLABatch
from clients.sampling import SamplingClient
from clients.sdk import Client, Job
from schemas import subjects
from schemas.events import Progress
from schemas.tenantctl import TENANT_REPLY_DECODER, CtlError
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from services.launcher import LocalStack

CALM, FLOOD = "calm", "flood"
FLOODS = ("garbage", "bad-call", "bad-act", "act")
#: Calm phases between the floods: each flood's ratio is against the mean of them all, so a
#: drift of the machine's load over the run hits both sides alike.
PHASES = ("none", "garbage", "bad-call", "none", "bad-act", "act", "none")
HEAD: dict[str, Any] = {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}
TOKEN_BUDGET = 16
#: Concurrent request loops of a flood: as many as the master answers of one tenant at once.
LOOPS = 16
ANSWER_TIMEOUT_S = 30.0
WARM_JOB = "calm-warm"
_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Tally:
    """What one kind of flood request was answered."""

    sent: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    #: Requests that got no answer within ANSWER_TIMEOUT_S.
    unanswered: int = 0

    def book(self, answer: str) -> None:
        self.sent += 1
        self.answers[answer] += 1


@dataclass
class Phase:
    flood: str
    sft_samples_per_s: float = 0.0
    act_per_s: float = 0.0
    act_p50_ms: float = 0.0
    losses: dict[int, float] = field(default_factory=dict)
    tallies: dict[str, Tally] = field(default_factory=dict)
    wall_s: float = 0.0


def _image(rng: np.random.Generator, side: int = 64) -> np.ndarray:
    return rng.integers(0, 256, (side, side, 3), dtype=np.uint8)


def _batch(rng: np.random.Generator, action_dim: int, nan: bool = False) -> VLABatch:
    actions = rng.uniform(-1, 1, (2, 4, action_dim)).astype(np.float32)
    if nan:
        actions[0, 0, 0] = np.nan
    return VLABatch(
        rng.integers(0, 255, (2, 1, 64, 64, 3), dtype=np.uint8),
        ["reach the red dot"] * 2,
        rng.standard_normal((2, 4)).astype(np.float32),
        actions,
    )


def _code(exc: BaseException) -> str:
    if isinstance(exc, RequestError):
        return exc.code
    if isinstance(exc, CallError):
        return "call_error_retryable" if exc.retryable else "call_error"
    return type(exc).__name__


async def _answered(tally: Tally, request: Awaitable[object]) -> None:
    """Await one flood request; book its answer (an error code, or ``ok``)."""
    try:
        answer = await asyncio.wait_for(request, ANSWER_TIMEOUT_S)
    except TimeoutError:
        tally.sent += 1
        tally.unanswered += 1
        return
    except (RequestError, CallError) as exc:
        tally.book(_code(exc))
        return
    tally.book(answer.code if isinstance(answer, CtlError) else "ok")


async def _garbage(client: Client, tally: Tally, rng: np.random.Generator) -> None:
    subject = subjects.tenant_ctl(FLOOD, "submit")

    async def ask() -> object:
        reply = await client.nc.request(subject, rng.bytes(64), timeout=ANSWER_TIMEOUT_S)
        return decode(TENANT_REPLY_DECODER, reply.data)

    await _answered(tally, ask())


async def _bad_call(training: TrainingClient, tally: Tally, rng: np.random.Generator) -> None:
    nan = tally.sent % 2 == 1
    batch = _batch(rng, HEAD["action_dim"], nan=True) if nan else _batch(rng, 3)
    await _answered(tally, training.forward_backward(batch))


async def _bad_act(sampling: SamplingClient, tally: Tally, rng: np.random.Generator) -> None:
    if tally.sent % 2 == 0:  # one side over the default max_image_side (512)
        obs = observation([_image(rng, 520)], "reach", rng.standard_normal(4).astype(np.float32))
    else:
        proprio = np.full(4, np.nan, np.float32)
        obs = observation([_image(rng)], "reach", proprio)
    await _answered(tally, sampling.act([obs]))


async def _good_act(sampling: SamplingClient, tally: Tally, rng: np.random.Generator) -> None:
    obs = observation([_image(rng)], "reach", rng.standard_normal(4).astype(np.float32))
    await _answered(tally, sampling.act([obs]))


async def flood(
    kind: str,
    service: ServiceClient,
    training: TrainingClient,
    sampling: SamplingClient,
    stop: asyncio.Event,
) -> dict[str, Tally]:
    """Run ``kind``'s flood loops until ``stop``; what each kind of request was answered."""
    tallies: dict[str, Tally] = {}
    loops: list[Any] = []

    def spawn(name: str, one: Any, target: Any, count: int) -> None:
        tally = tallies.setdefault(name, Tally())
        for i in range(count):
            rng = np.random.default_rng([len(name), i])

            async def loop(rng: np.random.Generator = rng) -> None:
                while not stop.is_set():
                    await one(target, tally, rng)

            loops.append(loop())

    floods = {
        "garbage": (_garbage, service.client),
        "bad-call": (_bad_call, training),
        "bad-act": (_bad_act, sampling),
        "act": (_good_act, sampling),
    }
    one, target = floods[kind]
    spawn(kind, one, target, LOOPS)
    await asyncio.gather(*loops)
    return tallies


async def flooder(kind: str, home: Path, ready: Path) -> dict[str, Tally]:
    """The flooding tenant's process: its own session and policy, then ``kind``'s flood
    until SIGTERM; what its requests were answered."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    service = await ServiceClient.connect(home=home, tenant=FLOOD)
    try:
        training = await service.create_training_client(
            head=HEAD, seed=1, token_budget=TOKEN_BUDGET
        )
        rng = np.random.default_rng(0)
        await training.forward_backward(_batch(rng, HEAD["action_dim"]))
        await training.optim_step(AdamParams(1e-3))
        sampling = await training.save_weights_and_get_sampling_client("v1")
        await asyncio.to_thread(ready.touch)
        tallies = await flood(kind, service, training, sampling, stop)
        await training.close()
    finally:
        await service.close()
    return tallies


def start_flooder(kind: str, home: Path, workdir: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """``kind``'s flooder process, at a lower CPU priority: a tenant's client runs on its own
    machine, and on this one its loops must not take the cores the services need (which
    would measure the machine, not the service). Returns it and where it writes its tally."""
    ready, out = workdir / f"{kind}.ready", workdir / f"{kind}.json"
    argv = [sys.executable, "-m", "bench.flood", "--flooder", kind, "--home", str(home)]
    argv += ["--ready", str(ready), "--out", str(out)]
    with (workdir / f"flooder-{kind}.log").open("ab") as log:
        proc = subprocess.Popen(
            argv,
            cwd=_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=lambda: os.nice(10),
        )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the {kind} flooder did not start; see {workdir}")
        time.sleep(0.1)  # the child says it is ready by a file; nothing to wait on
    return proc, out


def stop_flooder(proc: subprocess.Popen[bytes], out: Path) -> dict[str, Tally]:
    proc.send_signal(signal.SIGTERM)
    if proc.wait(120) != 0:
        raise SystemExit(f"the flooder exited with {proc.returncode}")
    tallies = {}
    for name, t in json.loads(out.read_text()).items():
        tallies[name] = Tally(t["sent"], Counter(t["answers"]), t["unanswered"])
    return tallies


async def calm_work(
    service: ServiceClient, spec: dict[str, Any], policy: SamplingClient, phase: Phase
) -> None:
    """The calm tenant's SFT job and its closed-loop act requests while the job runs."""
    done = asyncio.Event()
    latencies: list[float] = []
    rng = np.random.default_rng(7)

    async def act_loop() -> None:
        while not done.is_set():
            obs = observation([_image(rng)], "reach", rng.standard_normal(4).astype(np.float32))
            t0 = time.perf_counter()
            await policy.act([obs], deterministic=True)
            latencies.append(time.perf_counter() - t0)

    acting = asyncio.create_task(act_loop())
    t0 = time.perf_counter()
    job = await service.client.train_sft(spec)
    await job.wait(600)
    phase.wall_s = time.perf_counter() - t0
    done.set()
    await acting
    phase.sft_samples_per_s = spec["steps"] * spec["batch_size"] / phase.wall_s
    phase.act_per_s = len(latencies) / phase.wall_s
    phase.act_p50_ms = 1e3 * statistics.median(latencies) if latencies else float("nan")
    phase.losses = await _losses(job)


async def _losses(job: Job) -> dict[int, float]:
    losses: dict[int, float] = {}
    async for event in job.events(idle_timeout=30):
        if isinstance(event, Progress):
            losses[event.step] = event.metrics["loss"]
    return losses


async def dead_letters(info: StackInfo) -> dict[str, int]:
    """Dead letters per tenant so far (all streams)."""
    async with await Client.connect(
        info.url, creds=info.creds(OPERATOR_NAME), user=info.user, password=info.password
    ) as op:
        stream = await op.js.stream_info(subjects.STREAM_DEAD, subjects_filter=">")
    counts: Counter[str] = Counter()
    for subject, n in (stream.state.subjects or {}).items():
        counts[subject.rsplit(".", 1)[-1]] += n
    return dict(counts)


def calm_spec(steps: int, batch: int, dataset: str) -> dict[str, Any]:
    return {
        "kind": "sft",
        "tenant": CALM,
        "backbone": "tiny",
        "dataset": dataset,
        "head": HEAD,
        "steps": steps,
        "batch_size": batch,
        "seed": 0,
        "checkpoint_every": 20,
        "token_budget": TOKEN_BUDGET,
    }


async def calm_phase(info: StackInfo, spec: dict[str, Any], phase: Phase, warm: bool) -> None:
    service = await ServiceClient.connect(info.url, tenant=CALM, creds=info.creds(CALM))
    try:
        if warm:  # the policy the calm tenant asks for actions, and first-touch costs paid
            await (await service.client.train_sft(spec, job_id=WARM_JOB)).wait(600)
        policy = service.create_sampling_client(WARM_JOB)
        await calm_work(service, spec, policy, phase)
    finally:
        await service.close()


def run_phases(
    info: StackInfo, home: Path, workdir: Path, steps: int, batch: int, kinds: Sequence[str]
) -> list[Phase]:
    spec = calm_spec(steps, batch, "reach")
    phases = []
    for i, kind in enumerate(kinds):
        phase = Phase(kind)
        flooding = None if kind == "none" else start_flooder(kind, home, workdir)
        try:
            asyncio.run(calm_phase(info, spec, phase, warm=i == 0))
        finally:
            if flooding is not None:
                phase.tallies = stop_flooder(*flooding)
        phases.append(phase)
    return phases


def summarise(phases: list[Phase], dead: dict[str, int], alive: bool) -> dict[str, Any]:
    base = [p for p in phases if p.flood == "none"]
    sft0 = statistics.mean(p.sft_samples_per_s for p in base)
    act0 = statistics.mean(p.act_per_s for p in base)
    rows = []
    for p in phases:
        rows.append(
            {
                "flood": p.flood,
                "calm_sft_samples_per_s": p.sft_samples_per_s,
                "calm_sft_ratio": p.sft_samples_per_s / sft0,
                "calm_act_per_s": p.act_per_s,
                "calm_act_ratio": p.act_per_s / act0,
                "calm_act_p50_ms": p.act_p50_ms,
                "wall_s": p.wall_s,
                "flood_requests": {
                    k: {"sent": t.sent, "answers": dict(t.answers), "unanswered": t.unanswered}
                    for k, t in p.tallies.items()
                },
            }
        )
    first = phases[0].losses
    return {
        "phases": rows,
        "calm_losses_equal": all(p.losses == first for p in phases) and bool(first),
        "calm_dead_letters": dead.get(CALM, 0),
        "flood_dead_letters": dead.get(FLOOD, 0),
        "flood_unanswered": sum(t.unanswered for p in phases for t in p.tallies.values()),
        "roles_alive": alive,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'flood':<11}{'calm SFT/s':>12}{'ratio':>8}{'calm act/s':>12}{'ratio':>8}"
        f"{'act p50 ms':>12}  flood answered"
    )
    for r in result["phases"]:
        answered = "; ".join(
            f"{k}: " + ", ".join(f"{c} {n}" for c, n in v["answers"].items())
            for k, v in r["flood_requests"].items()
        )
        print(
            f"{r['flood']:<11}{r['calm_sft_samples_per_s']:>12.1f}{r['calm_sft_ratio']:>8.2f}"
            f"{r['calm_act_per_s']:>12.1f}{r['calm_act_ratio']:>8.2f}"
            f"{r['calm_act_p50_ms']:>12.1f}  {answered or '-'}"
        )
    print(
        f"calm losses equal in every phase: {result['calm_losses_equal']}; dead letters: "
        f"calm {result['calm_dead_letters']}, flood {result['flood_dead_letters']}; "
        f"flood requests unanswered: {result['flood_unanswered']}; "
        f"every role alive: {result['roles_alive']}"
    )


async def _register(info: StackInfo, data: Path) -> None:
    """The operator registers the calm tenant's dataset in its namespace."""
    async with await Client.connect(
        info.url, creds=info.creds(OPERATOR_NAME), user=info.user, password=info.password
    ) as op:
        await register_path(op.js, CALM, "reach", data)


def run(home: Path, steps: int, batch: int, phases: Sequence[str] = PHASES) -> dict[str, Any]:
    """The whole benchmark on a stack under ``home``; the summary."""
    data = home / "reach-data"
    record(REACH2D_ID, 24, data, seed=0)
    stack = LocalStack(
        home / "stack",
        tenants=(CALM, FLOOD),
        roles={"master": 1, "envs": 1, "trainer": 1, "inferencer": 1},
    )
    try:
        info = stack.start(120)
        asyncio.run(_register(info, data))
        pids = {c.name: c.proc.pid for c in stack.children if c.proc is not None}
        done = run_phases(info, home / "stack", home, steps, batch, phases)
        dead = asyncio.run(dead_letters(info))
        alive = all(
            c.proc is not None and c.proc.poll() is None and pids.get(c.name) == c.proc.pid
            for c in stack.children
        )
    finally:
        stack.stop()
    return summarise(done, dead, alive)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="joynexus bench flood", description=__doc__)
    p.add_argument("--steps", type=int, default=150, help="the calm SFT job's steps per phase")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--json", help="write the results here")
    # The flooder's own process (started by the benchmark).
    p.add_argument("--flooder", choices=FLOODS, help=argparse.SUPPRESS)
    p.add_argument("--home", help=argparse.SUPPRESS)
    p.add_argument("--ready", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.flooder:
        tallies = asyncio.run(flooder(args.flooder, Path(args.home), Path(args.ready)))
        answered = {
            k: {"sent": t.sent, "answers": dict(t.answers), "unanswered": t.unanswered}
            for k, t in tallies.items()
        }
        Path(args.out).write_text(json.dumps(answered))
        return 0
    with tempfile.TemporaryDirectory(prefix="joynexus-bench-flood-") as tmp:
        result = run(Path(tmp), args.steps, args.batch_size)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = (
        result["calm_losses_equal"]
        and result["calm_dead_letters"] == 0
        and result["flood_unanswered"] == 0
        and result["roles_alive"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
