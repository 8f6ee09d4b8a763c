"""A training batch that kills the trainer's process (an out-of-memory step, a crash in a
kernel: no exception, no settle) fails its own job only: the other tenants' steps that shared
its rounds are applied and their jobs finish. Before, the trainer counted every message it
held in the crash ledger at each restart (prefetched steps, applied ones waiting for their
commit), so all of them reached the crash limit together and every tenant in flight failed
beside the poison. The process is the real trainer with its grouped step made to die on the
poison tenant's rounds (``tests.crashing_trainer``), restarted by the test as a supervisor
would."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.connect import connect
from bus.declare import declare
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.dead import DeadLetter
from schemas.events import ErrorEvent
from schemas.model import OptimizerConfig
from tests.conftest import Procs
from tests.crashing_trainer import CRASHED
from tests.helpers import ROOT, dead_letters, eventually, service_env, start_service, uid
from tests.test_trainer_defects import (
    done,
    episode,
    events_of,
    rl_open,
    send,
    sft_batch,
    sft_open,
)

# Each restarts a real role until a poison reaches the crash limit (20-35 s): run by
# `make test-stack` with the heavy tests, to keep `make test` well under 15 minutes.
pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]

STEPS = 4
#: How the crashing trainer ends, by mode, when not with CRASHED: raised out of its loop.
_EXIT_CODES = {"raise": 1, "raise-after": 1}


def _start(
    url: str, poison: str, rounds: Path, log: Path, mode: str = "work"
) -> subprocess.Popen[bytes]:
    # max-deliver 3: a crash limit of 3; redelivered 2 s after a crash.
    flags = ["--deterministic", "--ack-wait-s", "2", "--max-deliver", "3"]
    if mode == "raise-after":  # no commit by time: the stop's is the one that counts
        flags += ["--commit-every-s", "600"]
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.crashing_trainer", mode, poison, str(rounds), *flags],
            cwd=ROOT,
            env=service_env(url),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


async def _all_settled(js: JetStreamContext, tenant: str) -> bool:
    info = await js.consumer_info(subjects.STREAM_TRAIN, subjects.trainer_durable("tiny", tenant))
    return info.num_ack_pending == 0 and info.num_pending == 0


async def _only_the_poison_failed(
    js: JetStreamContext,
    poison: str,
    calm: str,
    job: str,
    batches: int,
    crashes: int,
    rounds: Path,
) -> list[DeadLetter]:
    """A slot's opening or restore killed the process on the poison's job: the calm job has
    ``batches`` done and no dead letter; the poison's slot was tried once per crash (4: the
    first delivery's, uncounted, then three counted) and not again, its job's batches all
    settled. The poison's dead letters, for the caller to check."""
    assert await done(js, calm, job, batches) is not None
    assert await dead_letters(js, "TRAIN", calm) == []
    assert crashes == 4, _text(rounds)
    await eventually(
        lambda: _all_settled(js, poison), timeout=30, what="the poison job's batches settled"
    )
    assert _text(rounds).split().count(poison) == 4, _text(rounds)
    return await dead_letters(js, "TRAIN", poison)


async def _sft_jobs(js: JetStreamContext, job: str, *tenants: str) -> None:
    """Open an SFT job ``job`` of ``STEPS`` steps for each of ``tenants`` (no commit by step
    count before its end) and send all its batches."""
    for tenant in tenants:
        await send(js, tenant, sft_open(tenant, job, STEPS, checkpoint_every=100))
        await send(js, tenant, *(sft_batch(tenant, job, s) for s in range(STEPS)))


def _text(path: Path) -> str:
    return path.read_text()


async def _failed_in_a_crash_loop(js: JetStreamContext, tenant: str, job: str) -> None:
    """Wait for the job's fatal error event and check it names the crash loop."""

    async def failed() -> list[ErrorEvent]:
        events = await events_of(js, tenant, job)
        return [e for e in events if isinstance(e, ErrorEvent) and e.fatal]

    errors = await eventually(failed, what=f"{tenant}'s job failing")
    assert "in a row without finishing" in errors[0].message, errors


async def _run_until(
    url: str,
    procs: Procs,
    poison: str,
    rounds: Path,
    log: Path,
    calm: str,
    job: str,
    batches: int,
    mode: str = "work",
) -> tuple[int, subprocess.Popen[bytes]]:
    """Start the crashing trainer again each time it dies (bounded), until the calm job has
    ``batches`` done and the poison is dead-lettered; the crashes and the last process."""
    nc = await connect(url)
    js = nc.jetstream()
    crashes = 0
    try:
        for _ in range(8):  # bounded: 4 crashes are expected, then a run that carries on
            proc = procs.add(_start(url, poison, rounds, log, mode))
            deadline = time.monotonic() + 90
            while proc.poll() is None and time.monotonic() < deadline:
                if await done(js, calm, job, batches) and await dead_letters(js, "TRAIN", poison):
                    break
                await asyncio.sleep(0.2)  # polling a child process; it sends no event
            if proc.poll() is None:
                return crashes, proc
            assert proc.returncode == _EXIT_CODES.get(mode, CRASHED), _text(log)
            crashes += 1
    finally:
        await nc.close()
    raise AssertionError(f"still crashing after {crashes} starts: {_text(rounds)}")


@pytest.mark.parametrize("mode", ["work", "raise"])
async def test_a_batch_that_kills_the_trainer_fails_its_own_job_and_the_others_finish(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path, mode: str
) -> None:
    """``raise``: the step raises out of the trainer (a bug), which then exits; before, that
    start was taken back and the restarted trainer raised again for as long as the server
    redelivered the batch, every other tenant's steps replayed each time."""
    poison, calm, job = uid("poison"), uid("calm"), uid("j")
    rounds, log = tmp_path / "rounds", tmp_path / "trainer.log"
    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        await _sft_jobs(js, job, poison, calm)
        crashes, proc = await _run_until(
            fresh_server.url, procs, poison, rounds, log, calm, job, STEPS, mode
        )
        ran = [line.split() for line in rounds.read_text().splitlines()]
        both = sorted([poison, calm])
        assert any(sorted(r) == both for r in ran), ("the scenario: a round of both", ran)
        record = await done(js, calm, job, STEPS)
        assert record is not None, (ran, log.read_text()[-3000:])
        assert await dead_letters(js, "TRAIN", calm) == []
        dead = await dead_letters(js, "TRAIN", poison)
        assert [d.error_type for d in dead] == ["CrashLoopError"], dead
        # The first delivery's crash (uncounted), then three counted starts: twice beside the
        # calm tenant or alone, the last alone; the fourth count dead-letters it unstepped.
        assert crashes == 4, ran
        assert [r for r in ran if poison in r][-1] == [poison], ran
        await _failed_in_a_crash_loop(js, poison, job)
        assert procs.stop(proc) == 0, log.read_text()[-3000:]
    finally:
        await nc.close()


async def test_a_step_that_raises_after_stepping_leaves_no_half_applied_commit(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """The grouped step raises after it ran (a bug in what follows the optimizer step): the
    round's slots are stepped and their batches not booked. Before, the trainer's stop then
    committed them, and the calm tenant's replayed batch was applied a second time (its
    final version one step ahead of its batches)."""
    poison, calm, job = uid("poison"), uid("calm"), uid("j")
    rounds, log = tmp_path / "rounds", tmp_path / "trainer.log"
    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        await _sft_jobs(js, job, poison, calm)
        _, proc = await _run_until(
            fresh_server.url, procs, poison, rounds, log, calm, job, STEPS, "raise-after"
        )
        raised = [
            dict(at.split(":") for at in line.split()[1:])
            for line in rounds.read_text().splitlines()
            if line.startswith("raised ")
        ]
        # The scenario: a raising round stepped the calm tenant past a step already booked.
        assert any(int(r.get(calm, "0")) >= 2 for r in raised), rounds.read_text()
        record = await done(js, calm, job, STEPS)
        assert record is not None, log.read_text()[-3000:]
        assert (record.step, record.batches_done) == (STEPS, STEPS), record
        dead = await dead_letters(js, "TRAIN", poison)
        assert [d.error_type for d in dead] == ["CrashLoopError"], dead
        assert procs.stop(proc) == 0, log.read_text()[-3000:]
    finally:
        await nc.close()


@pytest.mark.parametrize("mode", ["work", "raise"])
async def test_an_rl_update_that_kills_the_trainer_fails_its_own_job_and_the_others_finish(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path, mode: str
) -> None:
    """The same for RL: the iterations of two jobs update together; the poison's kills the
    process. Its episodes are dead-lettered, the other job's iteration is committed."""
    poison, calm, job = uid("poison"), uid("calm"), uid("j")
    rounds, log = tmp_path / "rounds", tmp_path / "trainer.log"
    optim = OptimizerConfig(lr=1e-3)
    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        for tenant in (poison, calm):
            await send(js, tenant, rl_open(tenant, job, 1, lag=0, optim=optim))
            await send(js, tenant, episode(tenant, job, 0, 0, 1), episode(tenant, job, 0, 1, 1))
        crashes, proc = await _run_until(
            fresh_server.url, procs, poison, rounds, log, calm, job, 1, mode
        )
        ran = [line.split() for line in rounds.read_text().splitlines()]
        both = sorted([poison, calm])
        assert any(sorted(r) == both for r in ran), ("the scenario: an update of both", ran)
        assert await done(js, calm, job, 1) is not None
        assert await dead_letters(js, "TRAIN", calm) == []
        dead = await dead_letters(js, "TRAIN", poison)
        # Its episodes climbed together; the first past the limit ends the iteration (the
        # rest are consumed unapplied with the failed job).
        assert dead and all(d.error_type == "CrashLoopError" for d in dead), dead
        assert crashes == 4, ran
        assert [r for r in ran if poison in r][-1] == [poison], ran
        assert procs.stop(proc) == 0, log.read_text()[-3000:]
    finally:
        await nc.close()


async def test_a_slot_whose_restore_kills_the_trainer_fails_its_own_job_and_the_others_finish(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """Restoring a job's slot from its checkpoint (a restarted trainer, an evicted job) is
    work its first message starts: counted, so a restore that kills the process ends in a
    dead letter of that message, not a crash loop until the server stops delivering."""
    poison, calm, job = uid("poison"), uid("calm"), uid("j")
    rounds, log = tmp_path / "rounds", tmp_path / "trainer.log"
    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        first = procs.add(
            start_service("trainer", fresh_server.url, tmp_path / "first.log", "--deterministic")
        )
        for tenant in (poison, calm):
            await send(js, tenant, sft_open(tenant, job, 6, checkpoint_every=1))
            await send(js, tenant, *(sft_batch(tenant, job, s) for s in range(3)))

        async def committed_and_acked() -> bool:
            for tenant in (poison, calm):
                if await done(js, tenant, job, 3) is None:
                    return False
                durable = subjects.trainer_durable("tiny", tenant)
                info = await js.consumer_info(subjects.STREAM_TRAIN, durable)
                if info.num_ack_pending or info.num_pending:
                    return False
            return True

        await eventually(committed_and_acked, timeout=90, what="3 steps of both, acked")
        assert procs.stop(first) == 0
        # The next steps, served by a trainer that must restore both slots first.
        await send(js, poison, sft_batch(poison, job, 3), sft_batch(poison, job, 4))
        await send(js, calm, *(sft_batch(calm, job, s) for s in range(3, 6)))
        crashes, proc = await _run_until(
            fresh_server.url, procs, poison, rounds, log, calm, job, 6, mode="restore"
        )
        # The first delivery's (uncounted), then three counted restores; the job's next
        # batch is not restored from again (it would crash as many times more), but
        # consumed unapplied with its failing job.
        dead = await _only_the_poison_failed(js, poison, calm, job, 6, crashes, rounds)
        assert [d.error_type for d in dead] == ["CrashLoopError"], dead
        assert procs.stop(proc) == 0, log.read_text()[-3000:]
    finally:
        await nc.close()


async def test_a_slot_whose_opening_kills_the_trainer_fails_its_own_job_and_the_others_finish(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """Opening a job's slot (its head built, an init checkpoint loaded) is work its OpenSlot
    starts: counted, so an opening that kills the process ends in a dead letter of that
    OpenSlot, and the job's batches are consumed unapplied, not left waiting for a slot."""
    poison, calm, job = uid("poison"), uid("calm"), uid("j")
    rounds, log = tmp_path / "rounds", tmp_path / "trainer.log"
    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        for tenant in (poison, calm):
            await send(js, tenant, sft_open(tenant, job, 3))
            await send(js, tenant, *(sft_batch(tenant, job, s) for s in range(3)))
        crashes, proc = await _run_until(
            fresh_server.url, procs, poison, rounds, log, calm, job, 3, mode="open"
        )
        dead = await _only_the_poison_failed(js, poison, calm, job, 3, crashes, rounds)
        assert [(d.error_type, d.stream_seq) for d in dead] == [("CrashLoopError", 1)], dead
        assert procs.stop(proc) == 0, log.read_text()[-3000:]
    finally:
        await nc.close()


async def test_a_commit_that_kills_the_trainer_fails_its_own_job_and_the_others_finish(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """Writing a job's version (its state serialised and stored) is work the messages it
    covers start: counted, so a commit that kills the process ends in their dead letters and
    its job's failure. It used to go uncounted: the trainer died at every commit of the job,
    all tenants' work replayed each time, until the server stopped redelivering the job's
    messages (left unanswered). A suspect commit runs alone, so the calm job's work in
    flight is not blamed for it."""
    poison, calm, job = uid("poison"), uid("calm"), uid("j")
    rounds, log = tmp_path / "rounds", tmp_path / "trainer.log"
    calm_steps = 40  # the calm job is still stepping when the poison's commits start
    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        for tenant, steps in ((poison, STEPS), (calm, calm_steps)):
            await send(js, tenant, sft_open(tenant, job, steps, checkpoint_every=100))
            await send(js, tenant, *(sft_batch(tenant, job, s) for s in range(steps)))
        crashes, proc = await _run_until(
            fresh_server.url, procs, poison, rounds, log, calm, job, calm_steps, mode="commit"
        )
        assert await done(js, calm, job, calm_steps) is not None
        assert await dead_letters(js, "TRAIN", calm) == []
        dead = await dead_letters(js, "TRAIN", poison)
        assert dead and all(d.error_type == "CrashLoopError" for d in dead), dead
        # The first delivery's crash (uncounted), then three counted: the fourth count
        # dead-letters the job's first step as it starts again.
        assert crashes == 4, _text(rounds)
        runs = [run.splitlines() for run in _text(rounds).split("start\n")[1:]]
        # The commits that killed the third and fourth processes covered messages counted
        # already (suspects): each ran alone, no round under way or begun while it wrote.
        for run in runs[2:4]:
            assert run[-1] == f"commit {poison}", run
            last = len(run) - 1 - run[::-1].index(f"committing {poison}")
            assert sum(line.startswith("step ") for line in run[:last]) == run[:last].count(
                "stepped"
            ), run
            assert not any(line.startswith("step ") for line in run[last:]), run
        await eventually(
            lambda: _all_settled(js, poison), timeout=30, what="the poison job's batches settled"
        )
        await _failed_in_a_crash_loop(js, poison, job)
        assert procs.stop(proc) == 0, log.read_text()[-3000:]
    finally:
        await nc.close()
