"""Trainer defects B to F and H (issue 8), each shown over a real bus against the real
``python -m services.trainer``: training messages are published straight to ``TRAIN`` (as the
master and env workers would), and what the trainer commits and announces is read back."""

from __future__ import annotations

import signal
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nats.js import JetStreamContext

from bus.codec import decode
from bus.publish import publish
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.events import EVENT_DECODER, ErrorEvent, PolicyPublished, Progress
from schemas.model import HeadConfig, OptimizerConfig
from schemas.tensor import Tensor
from schemas.train import (
    POLICY_RECORD_DECODER,
    CloseSlot,
    OpenSlot,
    PolicyRecord,
    PPOConfig,
    RolloutBatch,
    SFTBatch,
)
from tests.conftest import Procs
from tests.helpers import eventually, server_without_jetstream, start_service, uid
from vla.slot import TenantSlot, lr_at

IMAGE = 16  # any size: the normaliser resizes to the backbone's
TOKENS = 8


def trainer(url: str, log: Path, procs: Procs, *args: str) -> subprocess.Popen[bytes]:
    return procs.add(start_service("trainer", url, log, "--deterministic", *args))


def sft_open(tenant: str, job: str, steps: int, **kw: Any) -> OpenSlot:
    head = HeadConfig(kind="oft", action_dim=2, proprio_dim=3, hidden_dim=32)
    return OpenSlot(
        tenant, job, head, OptimizerConfig(lr=1e-3), 0, steps, token_budget=TOKENS, **kw
    )


def sft_batch(tenant: str, job: str, step: int, *, nan: bool = False, b: int = 2) -> SFTBatch:
    rng = np.random.default_rng(step)
    proprio = rng.standard_normal((b, 3)).astype(np.float32)
    if nan:
        proprio[:] = np.nan
    return SFTBatch(
        tenant,
        job,
        step,
        0,
        step,
        Tensor.from_numpy(rng.integers(0, 255, (b, 1, IMAGE, IMAGE, 3), dtype=np.uint8)),
        ["reach"] * b,
        Tensor.from_numpy(proprio),
        Tensor.from_numpy(rng.uniform(-1, 1, (b, 1, 2)).astype(np.float32)),
        Tensor.from_numpy(np.zeros((b, 1), bool)),
    )


def rl_open(tenant: str, job: str, iterations: int, lag: int, optim: OptimizerConfig) -> OpenSlot:
    head = HeadConfig(kind="oft", action_dim=2, proprio_dim=3, hidden_dim=32, value_head=True)
    rl = PPOConfig(epochs=4, minibatch_size=64, episodes_per_iteration=2, max_policy_lag=lag)
    return OpenSlot(
        tenant, job, head, optim, 0, iterations, token_budget=TOKENS, checkpoint_every=1, rl=rl
    )


def episode(
    tenant: str, job: str, iteration: int, ep: int, version: int, t: int = 4, images: int = 4
) -> RolloutBatch:
    rng = np.random.default_rng(100 * iteration + ep)
    f32 = np.float32
    return RolloutBatch(
        tenant,
        job,
        iteration,
        ep,
        version,
        Tensor.from_numpy(rng.integers(0, 255, (images, 1, IMAGE, IMAGE, 3), dtype=np.uint8)),
        "reach",
        Tensor.from_numpy(rng.standard_normal((images, 3)).astype(f32)),
        Tensor.from_numpy(rng.uniform(-1, 1, (t, 1, 2)).astype(f32)),
        Tensor.from_numpy(np.full(t, -1.0, f32)),
        Tensor.from_numpy(np.zeros(t, f32)),
        Tensor.from_numpy(rng.standard_normal(t).astype(f32)),
        terminated=True,
        truncated=False,
    )


async def send(js: JetStreamContext, tenant: str, *bodies: object) -> None:
    for body in bodies:
        await publish(js, subjects.train("tiny", tenant), body)


async def record(js: JetStreamContext, tenant: str, job: str) -> PolicyRecord | None:
    kv = await js.key_value(subjects.KV_POLICIES)
    try:
        entry = await kv.get(f"{tenant}.{job}")
    except Exception:  # noqa: BLE001 - not committed yet
        return None
    return decode(POLICY_RECORD_DECODER, entry.value) if entry.value else None


async def events_of(js: JetStreamContext, tenant: str, job: str) -> list[object]:
    sub = await js.subscribe(f"{subjects.PREFIX}.event.{tenant}.{job}.*", ordered_consumer=True)
    found: list[object] = []
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            found.append(decode(EVENT_DECODER, msg.data))
    except Exception:  # noqa: BLE001 - nats TimeoutError: no more events
        return found
    finally:
        await sub.unsubscribe()


async def done(js: JetStreamContext, tenant: str, job: str, batches: int) -> PolicyRecord | None:
    rec = await record(js, tenant, job)
    return rec if rec is not None and rec.batches_done >= batches else None


@pytest.mark.timeout(120)
async def test_B_rl_with_policy_lag_keeps_every_episode_of_overlapping_iterations(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """Lag 1: iteration 1's episodes (collected with v1, like iteration 0's) arrive while
    iteration 0's are held, with the same episode indices and interleaved stream sequences."""
    tenant, job = uid("lag"), uid("j")
    optim = OptimizerConfig(lr=1e-3, total_steps=3)
    proc = trainer(nats_server.url, tmp_path / "trainer.log", procs)
    await send(js, tenant, rl_open(tenant, job, 3, lag=1, optim=optim))
    await send(
        js,
        tenant,
        episode(tenant, job, 0, 0, 1),
        episode(tenant, job, 1, 0, 1),
        episode(tenant, job, 0, 1, 1),
        episode(tenant, job, 1, 1, 1),
    )
    rec = await eventually(lambda: done(js, tenant, job, 2), timeout=60, what="2 iterations")
    assert rec.version == 3 and proc.poll() is None
    # F: the schedule is sized in iterations, so iteration i's update uses lr_at(i).
    progress = [e for e in await events_of(js, tenant, job) if isinstance(e, Progress)]
    lrs = {p.step: p.metrics["lr"] for p in progress}
    assert lrs[1] == pytest.approx(lr_at(optim, 0)) and lrs[2] == pytest.approx(lr_at(optim, 1))


@pytest.mark.timeout(120)
async def test_C_a_failed_rl_update_fails_the_job_with_a_clear_error(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    tenant, job = uid("rlfail"), uid("j")
    proc = trainer(nats_server.url, tmp_path / "trainer.log", procs)
    await send(js, tenant, rl_open(tenant, job, 3, lag=0, optim=OptimizerConfig()))
    # 3 observations for 4 transitions: the update cannot be built.
    await send(js, tenant, episode(tenant, job, 0, 0, 1), episode(tenant, job, 0, 1, 1, images=3))

    async def fatal() -> list[ErrorEvent]:
        evs = await events_of(js, tenant, job)
        return [e for e in evs if isinstance(e, ErrorEvent) and e.fatal]

    errors = await eventually(fatal, timeout=60, what="a fatal error event")
    # Found at intake (every rollout's tensors are checked against each other), naming them.
    assert "actions: 4 rows for 3 images" in errors[0].message
    assert proc.poll() is None


@pytest.mark.stack
@pytest.mark.timeout(150)
async def test_D_a_dropped_non_finite_batch_survives_a_crash_before_the_next_commit(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    tenant, job = uid("nan"), uid("j")
    args = ("--commit-every-s", "600")
    proc = trainer(nats_server.url, tmp_path / "t1.log", procs, *args)
    await send(js, tenant, sft_open(tenant, job, 3, checkpoint_every=100))
    await send(js, tenant, sft_batch(tenant, job, 0, nan=True), sft_batch(tenant, job, 1))

    async def stepped() -> bool:
        evs = await events_of(js, tenant, job)
        return any(isinstance(e, Progress) for e in evs)

    await eventually(stepped, timeout=60, what="step 1 applied")
    proc.send_signal(signal.SIGKILL)  # before any commit covers the dropped step 0
    proc.wait(10)
    trainer(nats_server.url, tmp_path / "t2.log", procs, *args)
    await send(js, tenant, sft_batch(tenant, job, 2))
    rec = await eventually(lambda: done(js, tenant, job, 3), timeout=60, what="3 batches")
    assert rec.step == 2  # two applied, one dropped
    errors = [e for e in await events_of(js, tenant, job) if isinstance(e, ErrorEvent)]
    assert errors and not any(e.fatal for e in errors) and "step 0 dropped" in errors[0].message


@pytest.mark.timeout(150)
async def test_E_slots_that_do_not_fit_together_take_turns_instead_of_crashing(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    spec = sft_open("x", "y", 4)
    one = TenantSlot("x", spec.head, spec.optimizer, 128).nbytes
    budget_mb = 1.5 * one / 2**20  # one slot fits, two do not
    proc = trainer(nats_server.url, tmp_path / "t.log", procs, "--memory-budget-mb", str(budget_mb))
    jobs = [(uid("budget"), uid("j")) for _ in range(2)]
    for tenant, job in jobs:
        await send(js, tenant, sft_open(tenant, job, 4))
    for step in range(4):
        for tenant, job in jobs:
            await send(js, tenant, sft_batch(tenant, job, step))
    for tenant, job in jobs:
        await eventually(partial(done, js, tenant, job, 4), timeout=90, what="4 steps")
    assert proc.poll() is None


@pytest.mark.timeout(150)
async def test_E_a_slot_larger_than_the_budget_fails_its_job_only(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    proc = trainer(nats_server.url, tmp_path / "t.log", procs, "--memory-budget-mb", "0.01")
    tenant, job = uid("huge"), uid("j")
    await send(js, tenant, sft_open(tenant, job, 2))

    async def fatal() -> list[ErrorEvent]:
        evs = await events_of(js, tenant, job)
        return [e for e in evs if isinstance(e, ErrorEvent) and e.fatal]

    errors = await eventually(fatal, timeout=60, what="a fatal error event")
    assert "budget" in errors[0].message and proc.poll() is None


@pytest.mark.timeout(150)
async def test_a_close_triaged_after_its_jobs_batch_was_picked_does_not_crash_the_trainer(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """OpenSlot, a batch and CloseSlot already queued when the trainer starts reach one
    round's triage together: the batch is picked, then the close removes its slot. The round
    must leave that batch out (it used to look up the removed slot's size and crash)."""
    closed, other = (uid("closed"), uid("j")), (uid("other"), uid("j"))
    await send(js, closed[0], sft_open(*closed, 4), sft_batch(*closed, 0), CloseSlot(*closed))
    await send(js, other[0], sft_open(*other, 2), sft_batch(*other, 0), sft_batch(*other, 1))
    log = tmp_path / "t.log"
    proc = trainer(nats_server.url, log, procs)
    await eventually(partial(done, js, *other, 2), timeout=60, what="the other job's 2 steps")
    assert proc.poll() is None and "closed slot" in log.read_text(errors="replace")


# With the slow ones: tests/test_broker_faults.py takes the broker away mid-job (every fetch
# fails until it is back) and the trainer lives through it, as every role.
@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_H_jetstream_errors_from_fetch_do_not_crash_the_trainer(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """While a server without JetStream holds the port, every pull request is answered with
    an error status (a NatsError from fetch, not a timeout): the trainer rides it out."""
    from bus.connect import connect
    from bus.declare import declare

    log = tmp_path / "t.log"
    proc = trainer(fresh_server.url, log, procs)
    tenant, job = uid("nojs"), uid("j")
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    await send(js, tenant, sft_open(tenant, job, 4), sft_batch(tenant, job, 0))
    await eventually(lambda: done(js, tenant, job, 1), timeout=60, what="step 0")
    await nc.close()
    fresh_server.kill()
    plain = procs.add(server_without_jetstream(fresh_server.port))
    try:
        await eventually(
            lambda: proc.poll() is not None or "failed" in log.read_text(errors="replace"),
            timeout=30,
            what="the trainer meeting JetStream errors",
        )
    finally:
        plain.kill()
        plain.wait()
    fresh_server.start()
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    try:
        await send(js, tenant, *(sft_batch(tenant, job, s) for s in (1, 2, 3)))
        await eventually(lambda: done(js, tenant, job, 4), timeout=60, what="4 steps")
        assert proc.poll() is None
    finally:
        await nc.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("bound", "max_deliver", "logged"),
    [
        # the latest waiting ones are handed back for later
        (("--max-buffered", "6"), "10", "come back in"),
        # no delivery to spare: fetched past the bound
        (("--max-buffered", "6"), "2", "fetching past the buffer's bound"),
        # the bound in bytes (a message here is about 1.8 KB: 3 fill 5.2 KB), not in count
        (("--max-buffered-mb", "0.005"), "10", "come back in"),
    ],
    ids=["messages", "messages-no-delivery-to-spare", "bytes"],
)
async def test_a_buffer_full_of_later_steps_still_fetches_the_step_they_wait_for(
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    procs: Procs,
    tmp_path: Path,
    bound: tuple[str, str],
    max_deliver: str,
    logged: str,
) -> None:
    """Steps 1..10 are queued before step 0 (as when step 0 is redelivered after a retry):
    with room for 6 messages (or 5.2 KB of them) the buffer fills with steps that wait for
    step 0, which would never be fetched. The latest waiting ones are handed back for later
    while they have more than half their deliveries left (the rest are their retries); else
    the buffer takes a prefetch more (up to twice its bound: 12). All 11 steps apply, in
    order."""
    tenant, job = uid("wedge"), uid("j")
    later = (sft_batch(tenant, job, s) for s in range(1, 11))
    await send(js, tenant, sft_open(tenant, job, 11), *later, sft_batch(tenant, job, 0))
    log = tmp_path / "t.log"
    args = (*bound, "--prefetch", "2", "--max-deliver", max_deliver)
    proc = trainer(nats_server.url, log, procs, *args)
    rec = await eventually(partial(done, js, tenant, job, 11), timeout=90, what="11 steps")
    assert rec.batches_done == 11
    assert logged in log.read_text(errors="replace")
    assert proc.poll() is None


@pytest.mark.timeout(120)
async def test_a_replayed_open_slot_brings_out_the_event_its_job_still_owes(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """The trainer committed a job's first version and stopped before its ``policy`` event
    went out; the OpenSlot is all that is redelivered (an RL job's rollouts and a session's
    calls come only after that event). The restarted trainer restores the job from it and
    publishes the owed event (it used to ack the replay and forget the job)."""
    from services.trainer.versions import write_version
    from vla.backbone import Backbone

    tenant, job = uid("owed"), uid("j")
    spec = sft_open(tenant, job, 4)
    slot = TenantSlot(
        f"{tenant}/{job}", spec.head, spec.optimizer, Backbone.load("tiny").hidden_size
    )
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    kv = await js.key_value(subjects.KV_POLICIES)
    await write_version(store, kv, spec, slot, revision=None)
    await send(js, tenant, spec)
    trainer(nats_server.url, tmp_path / "t.log", procs)

    async def policy_event() -> PolicyPublished | None:
        found = [e for e in await events_of(js, tenant, job) if isinstance(e, PolicyPublished)]
        return found[0] if found else None

    event = await eventually(policy_event, timeout=60, what="the owed policy event")
    assert event.version == 1 and not event.final


@pytest.mark.timeout(120)
async def test_a_buffer_waiting_for_a_step_that_never_comes_slows_at_twice_its_bound(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """Nothing left to hand back and the awaited step still not there: the buffer fetches
    past its bound a prefetch at a time up to twice it, then one message a second, and says
    so (memory grows slowly while a job waits for a step that may never come, and an awaited
    redelivery or a CloseSlot still gets through)."""
    from bus.connect import connect
    from bus.declare import declare

    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        tenant, job = uid("stuck"), uid("j")
        later = (sft_batch(tenant, job, s) for s in range(1, 21))  # step 0 never comes
        await send(js, tenant, sft_open(tenant, job, 21), *later)
        log = tmp_path / "t.log"
        args = ("--max-buffered", "6", "--prefetch", "2", "--max-deliver", "2")
        proc = trainer(fresh_server.url, log, procs, *args)
        await eventually(
            lambda: "fetching one a second" in log.read_text(errors="replace"),
            timeout=60,
            what="the trainer saying it fetches one a second",
        )
        assert "12 buffered messages" in log.read_text(errors="replace")
        assert proc.poll() is None
    finally:
        await nc.close()


@pytest.mark.timeout(120)
async def test_a_resident_jobs_messages_after_it_ended_are_consumed_unapplied(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """The job was cancelled (its record says so) and its CloseSlot has not reached the
    trainer (behind a backlog): its later batches are consumed, not trained on."""
    from bus.records import put_job
    from schemas.jobs import JobRecord

    tenant, job = uid("ended"), uid("j")
    await send(js, tenant, sft_open(tenant, job, 6, checkpoint_every=1))
    await send(js, tenant, sft_batch(tenant, job, 0), sft_batch(tenant, job, 1))
    trainer(nats_server.url, tmp_path / "t.log", procs)
    await eventually(partial(done, js, tenant, job, 2), timeout=60, what="2 steps")
    jobs = await js.key_value(subjects.KV_JOBS)
    cancelled = JobRecord(tenant, job, "sft", "cancelled", b"{}", 0.0, 0.0, "by a test")
    await put_job(jobs, cancelled, last=0)
    await send(js, tenant, sft_batch(tenant, job, 2), sft_batch(tenant, job, 3))

    async def drained() -> bool:
        info = await js.consumer_info("TRAIN", subjects.trainer_durable("tiny", tenant))
        return info.num_pending == 0 and info.num_ack_pending == 0

    await eventually(drained, timeout=30, what="the later batches consumed")
    rec = await record(js, tenant, job)
    assert rec is not None and rec.batches_done == 2
