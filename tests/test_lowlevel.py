"""The low-level API (:mod:`clients.lowlevel`) against the real roles, as subprocesses.

Shown: calls sent at once apply in call order and give bit for bit what the same calls give
in process (:func:`reference`: the trainer's own kernels on a slot of ours); bad calls come
back as typed errors and the session goes on; saved states load; a sampling client acts from
a saved version through an inferencer; a silent client's lease runs out and its session is
closed; a session shares grouped backbone forwards with another tenant's SFT job (counted)
and both reach the parameters they reach alone; a trainer SIGKILL in the middle of a
pipelined session loses and repeats no call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import io
import math
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch
from nats.js import JetStreamContext

from bench.lowlevel import make_batch
from bus.codec import decode
from bus.connect import connect
from bus.datasets import register_path
from bus.declare import declare
from bus.inference import observation
from bus.publish import publish
from bus.records import get_policy
from bus.server import EmbeddedServer
from clients.errors import RequestError
from clients.lowlevel import (
    AdamParams,
    CallError,
    CallOutput,
    ServiceClient,
    SessionClosed,
    TrainingClient,
    VLABatch,
)
from schemas import headers, subjects
from schemas.events import EVENT_DECODER, CallResult, Progress
from schemas.jobs import JobRecord
from schemas.model import HeadConfig, OptimizerConfig
from schemas.tenantctl import CallSession, ReadEvents
from schemas.tensor import Tensor
from schemas.train import ForwardBackward, OptimStep, SaveState
from services.envs.datasets import record as record_dataset
from services.envs.sims import REACH2D_ID
from services.trainer.jobs import JobSlot
from services.trainer.session import saved_by
from tests.conftest import Procs
from tests.helpers import eventually, start_service, uid
from tests.sft_helpers import follow, sft_spec
from vla import optimsteps
from vla.backbone import Backbone
from vla.grouping import TrainRequest, group_train_step
from vla.normalize import Normaliser
from vla.slot import SlotManager, TenantSlot

HEAD = {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}
TOKEN_BUDGET = 48  # the SFT spec's default: a session and an SFT job then share a group key


@dataclass(frozen=True)
class Plan:
    """A session's calls: ``iterations`` of (``accumulate`` forward_backwards, one
    optim_step)."""

    iterations: int
    accumulate: int = 2
    lr: float = 1e-3
    seed: int = 0

    def batches(self) -> list[list[VLABatch]]:
        return [
            [make_batch(1000 * self.seed + 10 * i + j) for j in range(self.accumulate)]
            for i in range(self.iterations)
        ]

    def send(self, training: TrainingClient) -> list[asyncio.Future[CallOutput]]:
        """Every call at once (nothing awaited in between)."""
        futures = []
        for group in self.batches():
            futures += [training.forward_backward(b) for b in group]
            futures.append(training.optim_step(AdamParams(self.lr, grad_clip=1.0)))
        return futures


def reference(plan: Plan, head: dict[str, int | str] = HEAD) -> tuple[list[float], TenantSlot]:
    """The plan's losses and final slot in process: the trainer's backbone, normaliser and
    kernels (a stack of one, as a tenant alone on the trainer runs)."""
    torch.use_deterministic_algorithms(True)
    backbone = Backbone.load("tiny")
    normaliser = Normaliser(backbone, 1, TOKEN_BUDGET)
    slot = TenantSlot(
        "ref", HeadConfig(**head), OptimizerConfig(), backbone.hidden_size, seed=plan.seed
    )
    losses = []
    for group in plan.batches():
        for b in group:
            inputs = normaliser.normalise_arrays(b.images, list(b.instructions), b.proprio)
            request = TrainRequest("ref", slot, inputs, torch.from_numpy(b.actions), "accumulate")
            result = group_train_step(backbone, [request])["ref"]
            assert not isinstance(result, Exception), result
            losses.append(result.loss)
        (step,) = optimsteps.optim_steps([slot], [optimsteps.AdamParams(plan.lr, grad_clip=1.0)])
        assert not isinstance(step, Exception), step
    return losses, slot


async def saved_slot(js: JetStreamContext, tenant: str, session: str) -> TenantSlot:
    record, _ = await get_policy(await js.key_value(subjects.KV_POLICIES), tenant, session)
    assert record is not None
    buffer = io.BytesIO()
    await (await js.object_store(subjects.OBJ_CHECKPOINTS)).get(
        record.object_name, writeinto=buffer
    )
    return TenantSlot.from_bytes(buffer.getvalue())


def assert_same_slot(a: TenantSlot, b: TenantSlot) -> None:
    assert a.step == b.step
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]), k


async def call_results(service: ServiceClient, session: str) -> list[CallResult]:
    """Every ``call`` event the session's stream holds, in order."""
    out: list[CallResult] = []
    after = 0
    while True:
        page = await service.client.read_events(ReadEvents(service.tenant, session, after))
        if not page.events:
            return out
        after = page.last_seq
        for stored in page.events:
            event = decode(EVENT_DECODER, stored.data)
            if isinstance(event, CallResult):
                out.append(event)


@pytest_asyncio.fixture
async def bus(fresh_server: EmbeddedServer) -> AsyncIterator[JetStreamContext]:
    nc = await connect(fresh_server.url)
    await declare(nc.jetstream())
    yield nc.jetstream()
    await nc.close()


def start_roles(
    url: str, logs: Path, procs: Procs, *roles: str
) -> dict[str, subprocess.Popen[bytes]]:
    args = {"trainer": ("--deterministic",)}
    return {
        role: procs.add(start_service(role, url, logs / f"{role}.log", *args.get(role, ())))
        for role in roles
    }


@pytest.mark.timeout(120)
async def test_closing_the_service_client_or_its_connection_ends_pending_calls(
    fresh_server: EmbeddedServer, bus: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """Found by an audit: a ServiceClient closed with a session open left the session's
    pending calls unresolved for ever (its follower took the closed connection for a passing
    outage), and the session's own close then raised. No trainer runs here: calls wait."""
    start_roles(fresh_server.url, tmp_path, procs, "master")
    tenant = uid("ll")
    service = await ServiceClient.connect(fresh_server.url, tenant=tenant)
    training = await service.create_training_client(head=HEAD, token_budget=TOKEN_BUDGET)
    pending = training.forward_backward(make_batch(1))
    await service.close(timeout=30)  # closes the session, then the connection
    with pytest.raises(SessionClosed, match="its service client closed"):
        await asyncio.wait_for(pending, 30)
    await asyncio.wait_for(training.close(), 10)  # again: nothing left to do
    # The connection closed under an open session (no close of its own): its calls end too.
    other = await ServiceClient.connect(fresh_server.url, tenant=tenant)
    session = await other.create_training_client(head=HEAD, token_budget=TOKEN_BUDGET)
    waiting = session.forward_backward(make_batch(2))
    await other.client.close()
    with pytest.raises(SessionClosed, match="its connection closed"):
        await asyncio.wait_for(waiting, 30)
    await asyncio.wait_for(session.close(), 10)


@pytest.mark.timeout(240)
async def test_pipelined_calls_apply_in_order_as_in_process_with_errors_states_and_sampling(
    fresh_server: EmbeddedServer, bus: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    start_roles(fresh_server.url, tmp_path, procs, "master", "trainer", "inferencer")
    tenant = uid("ll")
    service = await ServiceClient.connect(fresh_server.url, tenant=tenant)
    try:
        training = await service.create_training_client(head=HEAD, token_budget=TOKEN_BUDGET)
        plan = Plan(iterations=4)
        futures = plan.send(training)
        saved = training.save_state("after-4")
        outputs = await asyncio.wait_for(asyncio.gather(*futures), 120)
        assert [o.call for o in outputs] == list(range(len(futures)))
        assert [o.op for o in outputs] == ["forward_backward", "forward_backward", "optim_step"] * 4
        ref_losses, ref_slot = reference(plan)
        assert [o.loss for o in outputs if o.op == "forward_backward"] == ref_losses
        assert [o.metrics["step"] for o in outputs if o.op == "optim_step"] == [1, 2, 3, 4]
        version = (await saved).version
        assert version >= 2
        assert_same_slot(await saved_slot(bus, tenant, training.session_id), ref_slot)

        # Bad calls fail their own future, naming the problem; the session goes on.
        with pytest.raises(CallError, match="no gradients accumulated"):
            await training.optim_step()
        wrong = make_batch(7)
        wrong = VLABatch(wrong.images, wrong.instructions, wrong.proprio, wrong.actions[:, :3])
        with pytest.raises(CallError, match=r"actions: expected float32 \(4, 4, 2\)") as bad:
            await training.forward_backward(wrong)
        assert not bad.value.retryable
        with pytest.raises(CallError, match="no state 'nope' was saved"):
            await training.load_state("nope")
        with pytest.raises(CallError, match="'after-4' is saved already"):
            await training.save_state("after-4")
        # A malformed call (as a non-SDK client could send) is answered, not a trainer crash.
        good = make_batch(8)
        scalar = Tensor.from_numpy(np.array(1.0, np.float32))
        malformed = ForwardBackward(
            tenant,
            training.session_id,
            training._number(),
            Tensor.from_numpy(good.images),
            list(good.instructions),
            Tensor.from_numpy(good.proprio),
            scalar,
        )
        with pytest.raises(CallError, match="actions"):
            await training._send(malformed)
        # An empty tensor with a dim no array can address (found by an audit: it crashed the
        # trainer on every start while the call was redelivered) is answered too.
        unaddressable = msgspec.structs.replace(
            malformed,
            call=training._number(),
            actions=Tensor("float32", (8, 0, 2**63 - 1), b""),
        )
        with pytest.raises(CallError, match=r"actions: invalid shape .* more bytes than"):
            await training._send(unaddressable)
        # A batch too big for one message is refused before it takes a call number.
        numbered = training.next_call
        huge = make_batch(9, size=400)
        with pytest.raises(ValueError, match="max_payload"):
            training.forward_backward(huge)
        assert training.next_call == numbered
        forward = await training.forward(make_batch(99))
        assert math.isfinite(forward.loss)
        # A forward changes nothing; training on, then loading the saved state, goes back.
        await training.forward_backward(make_batch(5))
        await training.optim_step(AdamParams(1e-2))
        loaded = await training.load_state("after-4")
        assert loaded.version == version and loaded.metrics["step"] == 4
        again = await training.forward(make_batch(99))
        assert again.loss == forward.loss
        # A saved state whose object lost its chunks is answered as damaged, once (it was
        # retried every round for ever); the session goes on.
        await training.save_state("to-damage")
        record, _ = await get_policy(
            await bus.key_value(subjects.KV_POLICIES), tenant, training.session_id
        )
        assert record is not None
        store = await bus.object_store(subjects.OBJ_CHECKPOINTS)
        nuid = (await store.get_info(record.object_name)).nuid
        await bus.purge_stream(
            f"OBJ_{subjects.OBJ_CHECKPOINTS}", subject=f"$O.{subjects.OBJ_CHECKPOINTS}.C.{nuid}"
        )
        with pytest.raises(CallError, match=r"'to-damage' does not load: .* is damaged") as lost:
            await asyncio.wait_for(training.load_state("to-damage"), 30)
        assert not lost.value.retryable
        assert (await training.forward(make_batch(99))).loss == forward.loss

        # Sampling from exactly the version saved for it, through an inferencer.
        sampling = await training.save_weights_and_get_sampling_client("for-sampler")
        obs = observation([np.zeros((32, 32, 3), np.uint8)], "reach", np.zeros(4, np.float32))
        sampled = await sampling.sample(obs, 3, seed=1)
        assert sampled.actions.shape == (3, 4, 2) and sampled.log_probs.shape == (3,)
        assert sampled.version == sampling.version

        # Requests the master refuses: a foreign tenant's call, a job that is no session.
        call = OptimStep("someone-else", training.session_id, 99, 1e-3)
        with pytest.raises(RequestError, match="for someone-else"):
            await service.client.request(tenant, CallSession(tenant, training.session_id, call))
        unknown = OptimStep(tenant, "no-such-session", 0, 1e-3)
        with pytest.raises(RequestError, match="no session 'no-such-session'") as missing:
            await service.client.request(tenant, CallSession(tenant, "no-such-session", unknown))
        assert missing.value.code == "not_found"

        # A client that goes silent loses its session when the lease runs out.
        silent = await service.create_training_client(head=HEAD, lease_s=2.0)
        assert silent._lease is not None
        silent._lease.cancel()  # stands for a client that died

        async def cancelled() -> JobRecord | None:
            record = await service.client.status(tenant, silent.session_id)
            return record if record is not None and record.status == "cancelled" else None

        record = await eventually(cancelled, timeout=30, what="the silent session closed")
        assert "lease expired" in record.reason
        with pytest.raises(SessionClosed):
            await asyncio.wait_for(silent.optim_step(), 20)
        await silent.close()
        await training.close()
        closed = await service.client.status(tenant, training.session_id)
        assert closed is not None and closed.status == "cancelled"
    finally:
        await service.close()


@pytest.mark.timeout(180)
async def test_a_save_state_delivered_again_gets_its_own_answer_again(
    fresh_server: EmbeddedServer, bus: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """A ``save_state`` delivered again after it was applied (its ack lost, or published
    again past the duplicate window) is answered again as it was: the call that saved a
    name gets that version once more; a call that was refused because another call had
    saved the name gets no success answer with the other call's version."""
    start_roles(fresh_server.url, tmp_path, procs, "master", "trainer")
    tenant = uid("ll")
    service = await ServiceClient.connect(fresh_server.url, tenant=tenant)
    try:
        training = await service.create_training_client(head=HEAD, token_budget=TOKEN_BUDGET)
        session = training.session_id
        await training.forward_backward(make_batch(1))
        await training.optim_step()
        saved = await training.save_state("kept")
        with pytest.raises(CallError, match="'kept' is saved already"):
            await training.save_state("kept")
        refused_call, saved_call = saved.call + 1, saved.call
        # Answers are published with their call's message id: within the duplicate window a
        # second answer is dropped by the stream. Delivered again past it:
        events = (await bus.stream_info(subjects.STREAM_EVENTS)).config
        await bus.update_stream(dataclasses.replace(events, duplicate_window=0.5))
        # The window, not an event: nothing to wait on. The server forgets an id on a timer,
        # which runs late on a loaded CPU (one window's wait failed once with two test
        # processes at once), so six of them.
        await asyncio.sleep(3.0)
        for number in (refused_call, saved_call):  # the refused one first, in stream order
            await publish(
                bus,
                subjects.train("tiny", tenant),
                SaveState(tenant, session, number, "kept"),
                message_id=f"replayed-{uid('call')}",
                headers={headers.JOB_ID: session},
            )
        await bus._nc.publish(subjects.train_wake("tiny"), b"")

        # The refused call's copy waits for a commit past it (applied, not committed yet);
        # the next save commits one. A forward after it is answered once both copies were
        # settled (one tenant's calls are triaged in stream order).
        later = await training.save_state("later")
        assert math.isfinite((await training.forward(make_batch(2))).loss)
        results = await call_results(service, session)
        answers = [(r.call, r.version, bool(r.error)) for r in results if r.op == "save_state"]
        assert answers == [
            (saved_call, saved.version, False),
            (refused_call, 0, True),
            (saved_call, saved.version, False),  # answered again: its own version
            (later.call, later.version, False),
        ]
        await training.close()
    finally:
        await service.close()


def test_which_replayed_save_is_answered_with_the_saved_version() -> None:
    """The call that saved a name is; another call of the name is not; with a record from
    before the saving calls were kept, any call of a saved name is (as before)."""
    kept = {"kept": "acme/s/v2-ab"}
    job = cast(JobSlot, SimpleNamespace(saved=kept, saved_calls={"kept": 2}))
    assert saved_by(job, SaveState("acme", "s", 2, "kept"))
    assert not saved_by(job, SaveState("acme", "s", 3, "kept"))
    assert not saved_by(job, SaveState("acme", "s", 2, "other"))
    old = cast(JobSlot, SimpleNamespace(saved=kept, saved_calls={}))
    assert saved_by(old, SaveState("acme", "s", 3, "kept"))


async def drive(training: TrainingClient, plan: Plan) -> list[CallOutput]:
    return list(await asyncio.gather(*plan.send(training)))


@pytest.mark.timeout(300)
async def test_a_session_shares_grouped_forwards_with_another_tenants_sft_job(
    fresh_server: EmbeddedServer, bus: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    start_roles(fresh_server.url, tmp_path, procs, "master", "envs", "trainer")
    alice, bob = uid("ll"), uid("sft")
    record_dataset(REACH2D_ID, 6, tmp_path / "demos", seed=0)
    await register_path(bus, bob, "demos", tmp_path / "demos")
    # A head of another width than the SFT job's: the backbone forward is shared, the head
    # kernels are not stacked (stacked heads are tested bit for bit in test_batched_heads).
    head = {**HEAD, "hidden_dim": 32}
    sft = sft_spec(bob, "demos", HEAD, steps=12, batch_size=4)
    service = await ServiceClient.connect(fresh_server.url, tenant=alice)
    try:
        plan = Plan(iterations=6, seed=3)
        alone = await service.create_training_client(head=head, seed=3, token_budget=TOKEN_BUDGET)
        alone_outputs = await asyncio.wait_for(drive(alone, plan), 120)
        await alone.save_state("end")
        alone_slot = await saved_slot(bus, alice, alone.session_id)
        sft_alone = await asyncio.wait_for(follow(await service.client.train_sft(sft)), 180)

        shared = await service.create_training_client(head=head, seed=3, token_budget=TOKEN_BUDGET)
        job = await service.client.train_sft(sft)
        started = asyncio.Event()

        async def follow_sft() -> dict[int, float]:
            losses = {}
            async for event in job.events(idle_timeout=180):
                if isinstance(event, Progress):
                    losses[event.step] = event.metrics["loss"]
                    started.set()
            return losses

        sft_task = asyncio.create_task(follow_sft())
        # The session's calls go once the SFT job is stepping: they meet in the rounds.
        await asyncio.wait_for(started.wait(), 120)
        shared_outputs = await asyncio.wait_for(drive(shared, plan), 120)
        sft_shared = await asyncio.wait_for(sft_task, 180)
        await shared.save_state("end")
        grouped = [o for o in shared_outputs if o.metrics.get("group_size", 1) >= 2]
        assert grouped, "no forward_backward shared a backbone forward with the SFT job"
        assert [o.metrics for o in shared_outputs if o.op == "optim_step"] == [
            o.metrics for o in alone_outputs if o.op == "optim_step"
        ]
        fb = "forward_backward"
        assert [o.loss for o in shared_outputs if o.op == fb] == [
            o.loss for o in alone_outputs if o.op == fb
        ]
        assert_same_slot(await saved_slot(bus, alice, shared.session_id), alone_slot)
        assert sft_shared == sft_alone.losses
        print(f"{len(grouped)} of {plan.iterations * plan.accumulate} forward_backwards grouped")
        await alone.close()
        await shared.close()
    finally:
        await service.close()


@pytest.mark.stack
@pytest.mark.timeout(300)
async def test_a_trainer_sigkill_mid_session_loses_and_repeats_no_call(
    fresh_server: EmbeddedServer, bus: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    roles = start_roles(fresh_server.url, tmp_path, procs, "master", "trainer")
    tenant = uid("ll")
    service = await ServiceClient.connect(fresh_server.url, tenant=tenant)
    try:
        plan = Plan(iterations=10, seed=5)
        training = await service.create_training_client(
            head=HEAD, seed=plan.seed, token_budget=TOKEN_BUDGET, checkpoint_every=4
        )
        futures = plan.send(training)
        # Kill once some calls are answered and committed, and many are still to come.
        await asyncio.wait_for(asyncio.gather(*futures[:7]), 120)
        assert not all(f.done() for f in futures), "the session ended before the kill"
        trainer = roles["trainer"]
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        procs.add(
            start_service("trainer", fresh_server.url, tmp_path / "trainer2.log", "--deterministic")
        )
        outputs = await asyncio.wait_for(asyncio.gather(*futures), 180)
        await training.save_state("end")
        ref_losses, ref_slot = reference(plan)
        assert [o.loss for o in outputs if o.op == "forward_backward"] == ref_losses
        assert_same_slot(await saved_slot(bus, tenant, training.session_id), ref_slot)
        answered = await call_results(service, training.session_id)
        numbers = [r.call for r in answered]
        assert sorted(numbers) == list(range(len(futures) + 1)), numbers  # each call once
        await training.close()
    finally:
        await service.close()


# With the slow ones: the other tests here drive the same calls (every op, errors, leases,
# sharing, a trainer SIGKILL); this one runs the example script's algorithm to learning.
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_custom_algorithm_example_learns_with_the_low_level_api_only(
    fresh_server: EmbeddedServer, bus: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """``examples/custom_algorithm.py`` (DAgger on Reach2D): its policy's success rate rises
    over the iterations, to most episodes reached."""
    start_roles(fresh_server.url, tmp_path, procs, "master", "trainer", "inferencer")
    path = Path(__file__).parents[1] / "examples" / "custom_algorithm.py"
    spec = importlib.util.spec_from_file_location("custom_algorithm", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses look their module up
    try:
        spec.loader.exec_module(example)
        service = await ServiceClient.connect(fresh_server.url, tenant=uid("dagger"))
        try:
            rates = await asyncio.wait_for(example.dagger(service, iterations=4, steps=40), 200)
        finally:
            await service.close()
    finally:
        sys.modules.pop(spec.name, None)
    policy = rates[1:]  # iteration 0 rolls out the expert
    assert policy[-1] >= 0.75, rates
    assert policy[-1] > policy[0], rates


def test_accumulated_gradients_survive_a_checkpoint_and_an_eviction() -> None:
    """A session between forward_backward and optim_step: its gradients travel in the slot's
    bytes (a checkpoint, or an eviction under the memory budget) and come back equal."""
    backbone = Backbone.load("tiny")
    normaliser = Normaliser(backbone, 1, TOKEN_BUDGET)
    one = TenantSlot("a", HeadConfig(**HEAD), OptimizerConfig(), backbone.hidden_size)
    manager = SlotManager(int(1.5 * one.nbytes))  # room for one slot only
    slot = manager.create("a", HeadConfig(**HEAD), OptimizerConfig(), backbone.hidden_size)
    b = make_batch(3)
    inputs = normaliser.normalise_arrays(b.images, list(b.instructions), b.proprio)
    request = TrainRequest("a", slot, inputs, torch.from_numpy(b.actions), "accumulate")
    assert not isinstance(group_train_step(backbone, [request])["a"], Exception)
    grads = {n: p.grad.clone() for n, p in slot.module.named_parameters() if p.grad is not None}
    assert grads and slot.has_grads()
    restored = TenantSlot.from_bytes(slot.to_bytes())
    for name, p in restored.module.named_parameters():
        assert torch.equal(p.grad, grads[name]) if name in grads else p.grad is None, name
    manager.create("b", HeadConfig(**HEAD), OptimizerConfig(), backbone.hidden_size)
    assert manager.resident == ["b"]  # "a" was evicted to bytes
    back = manager.get("a")
    for name, p in back.module.named_parameters():
        assert torch.equal(p.grad, grads[name]) if name in grads else p.grad is None, name


# With the slow ones: tests/test_master_replay.py SIGKILLs the master with an open session
# (its lease rebuilt) and the default suite's chaos test kills it mid-workload.
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_session_goes_on_across_a_master_sigkill(
    fresh_server: EmbeddedServer, bus: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """The master queues calls, keeps leases and pages events: SIGKILLed with calls in
    flight, the client's calls are asked again (the same call numbers: no duplicate), the
    restarted master adopts the open session's lease, and the session's result is exactly
    the in-process one."""
    roles = start_roles(fresh_server.url, tmp_path, procs, "master", "trainer")
    tenant = uid("ll")
    service = await ServiceClient.connect(fresh_server.url, tenant=tenant)
    try:
        plan = Plan(iterations=8, seed=11)
        training = await service.create_training_client(
            head=HEAD, seed=plan.seed, token_budget=TOKEN_BUDGET, lease_s=30.0
        )
        futures = plan.send(training)
        await asyncio.wait_for(asyncio.gather(*futures[:4]), 120)
        assert not all(f.done() for f in futures), "the session ended before the kill"
        roles["master"].send_signal(signal.SIGKILL)
        roles["master"].wait(10)
        procs.add(start_service("master", fresh_server.url, tmp_path / "master2.log"))
        outputs = await asyncio.wait_for(asyncio.gather(*futures), 120)
        await training.save_state("end")
        ref_losses, ref_slot = reference(plan)
        assert [o.loss for o in outputs if o.op == "forward_backward"] == ref_losses
        assert_same_slot(await saved_slot(bus, tenant, training.session_id), ref_slot)
        record = await service.client.status(tenant, training.session_id)
        assert record is not None and record.status == "running"  # the lease was adopted
        await training.close()
    finally:
        await service.close()
