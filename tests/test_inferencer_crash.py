"""A request that kills the inferencer's process (an out-of-memory forward, a crash in a
kernel: no exception, no settle) is dead-lettered alone, and the requests that shared its
batch are answered. Before, every request of the batch in flight was counted in the crash
ledger at each restart and batched with the poison again, so all of them reached the crash
limit together and were dead-lettered beside it. The process is the real service with its
batch runner made to die on the poison tenant's requests (``tests.crashing_inferencer``),
restarted by the test as a supervisor would.

A suspect's policy is loaded while the other jobs' requests are served: after a restart every
policy is cold, and the suspect's load ran inside its time alone, so one slow checkpoint read
held up every request on that replica. Uncounted, that load is marked: one that kills the
process is done inside the suspect's counted run next time, so the loop still ends."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.connect import connect
from bus.declare import declare
from bus.inference import InferenceError, PolicyClient
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.infer import ActReply
from tests.conftest import Procs
from tests.crashing_inferencer import CRASHED
from tests.helpers import ROOT, dead_letters, eventually, service_env, uid
from tests.test_inferencer import FLOW, commit_policy, make_obs
from vla.backbone import Backbone

# Each restarts a real role until a poison reaches the crash limit (20-35 s): run by
# `make test-stack` with the heavy tests, to keep `make test` well under 15 minutes.
pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]


def _start(
    url: str, poison: str, batches: Path, log: Path, bid: str, hold: list[str] | None = None
) -> subprocess.Popen[bytes]:
    """The crashing inferencer; ``hold``: its flags for policy loads
    (:mod:`tests.crashing_inferencer`)."""
    flags = ["--backbone-id", bid, "--instance", uid("inf"), "--ack-wait-s", "2"]
    # max-deliver 2: a crash limit of 2; B = the 3 requests (T well past their policies'
    # loads), so the first delivery's requests share one batch.
    flags += ["--max-deliver", "2", "--target-batch", "3", "--max-wait-ms", "2000"]
    held = hold or []
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.crashing_inferencer",
                poison,
                str(batches),
                *held,
                *flags,
            ],
            cwd=ROOT,
            env=service_env(url),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


@contextlib.asynccontextmanager
async def _policies(
    url: str, bid: str, *tenants: str
) -> AsyncIterator[tuple[JetStreamContext, PolicyClient]]:
    """The bus declared, a committed policy of job ``job`` for each of ``tenants``, and a
    policy client for backbone ``bid``."""
    nc = await connect(url)
    try:
        js = nc.jetstream()
        await declare(js)
        hidden = Backbone.load("tiny").hidden_size
        for tenant in tenants:
            await commit_policy(js, tenant, "job", FLOW, hidden)
        async with await PolicyClient.create(nc, bid, js) as client:
            yield js, client
    finally:
        await nc.close()


async def test_a_request_that_kills_the_inferencer_dies_alone_and_its_batch_mates_are_answered(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    bid, poison, calm = uid("crashinf"), uid("poison"), uid("calm")
    batches, log = tmp_path / "batches", tmp_path / "inferencer.log"
    async with _policies(fresh_server.url, bid, poison, calm) as (js, client):
        calls = [
            asyncio.create_task(client.act(tenant, "job", [make_obs(FLOW, i)], timeout=240))
            for i, tenant in enumerate([calm, poison, calm])
        ]

        async def all_queued() -> bool:
            info = await js.stream_info(subjects.STREAM_INFER)
            return info.state.messages == 3

        await eventually(all_queued, what="the three requests in the stream")
        crashes = 0
        for _ in range(8):  # bounded: 3 crashes are expected, then a run that carries on
            proc = procs.add(_start(fresh_server.url, poison, batches, log, bid))
            deadline = time.monotonic() + 90
            while proc.poll() is None and time.monotonic() < deadline:
                if all(call.done() for call in calls):
                    break
                await asyncio.wait(calls, timeout=0.1)  # and the child, which sends no event
            if proc.poll() is None:
                break
            assert proc.returncode == CRASHED, log.read_text()
            crashes += 1
        replies = await asyncio.gather(*calls, return_exceptions=True)
        ran = [line.split() for line in batches.read_text().splitlines()]
        three = sorted([calm, poison, calm])
        assert any(sorted(batch) == three for batch in ran), ("the scenario: a batch of 3", ran)
        for reply in (replies[0], replies[2]):
            assert isinstance(reply, ActReply), (reply, log.read_text())
            assert reply.actions is not None
            assert reply.actions.to_numpy().shape == (1, FLOW.chunk_len, FLOW.action_dim)
        refused = replies[1]
        assert isinstance(refused, InferenceError), refused
        assert "began 3 times in a row" in str(refused) and not refused.retryable, refused
        # Twice in a batch of three (the first delivery's and the first counted one), once
        # alone (counted a second time), then dead-lettered unhandled at the third count.
        assert crashes == 3, ran
        assert [batch for batch in ran if poison in batch][-1] == [poison], ran
        dead = await eventually(
            lambda: dead_letters(js, "INFER", poison), what="the poison's dead letter"
        )
        assert len(dead) == 1 and dead[0].error_type == "CrashLoopError", dead
        assert await dead_letters(js, "INFER", calm) == []
        assert procs.stop(proc) == 0, log.read_text()


async def _crashes(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``proc`` has died on the poison's batch (bounded)."""

    async def ended() -> bool:
        return proc.poll() is not None

    await eventually(ended, timeout=90, what="the inferencer's crash on the poison")
    assert proc.returncode == CRASHED, _text(log)


def _text(path: Path) -> str:
    return path.read_text()


async def test_a_suspects_slow_policy_load_does_not_hold_up_the_other_jobs(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    bid, poison, calm = uid("suspectload"), uid("poison"), uid("calm")
    batches, log, marker = tmp_path / "batches", tmp_path / "inferencer.log", tmp_path / "held"
    async with _policies(fresh_server.url, bid, poison, calm) as (_, client):
        doomed = asyncio.create_task(client.act(poison, "job", [make_obs(FLOW, 0)], timeout=240))
        # Two runs die on it: its first delivery (not counted), then its first counted one.
        for _ in range(2):
            await _crashes(procs.add(_start(fresh_server.url, poison, batches, log, bid)), log)
        # The third finds it a suspect, whose policy's checkpoint read is held.
        hold = ["--hold-load", poison, str(marker)]
        proc = procs.add(_start(fresh_server.url, poison, batches, log, bid, hold))
        await eventually(marker.exists, timeout=90, what="the suspect's policy load")
        served = await client.act(calm, "job", [make_obs(FLOW, 1)], timeout=30)
        assert served.error == "" and served.actions is not None, served.error
        assert proc.poll() is None, _text(log)
        # Released, the suspect runs alone (counted twice now: the limit) and dies.
        proc.send_signal(signal.SIGUSR1)
        await _crashes(proc, log)
        doomed.cancel()
        ran = [line.split() for line in batches.read_text().splitlines()]
        assert ran == [[poison], [poison], [calm], [poison]], ran


async def test_a_policy_load_that_kills_the_inferencer_ends_at_the_crash_limit(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    bid, poison, calm = uid("loadkill"), uid("poison"), uid("calm")
    batches, log = tmp_path / "batches", tmp_path / "inferencer.log"
    async with _policies(fresh_server.url, bid, poison, calm) as (js, client):
        doomed = asyncio.create_task(client.act(poison, "job", [make_obs(FLOW, 0)], timeout=240))
        # Its first delivery (uncounted), its first counted start, its load as a suspect
        # beside the others (uncounted, marked), then its load inside its run alone
        # (counted a second time: the limit).
        for _ in range(4):
            flags = ["--die-on-load"]
            await _crashes(
                procs.add(_start(fresh_server.url, poison, batches, log, bid, flags)), log
            )
        proc = procs.add(_start(fresh_server.url, poison, batches, log, bid, ["--die-on-load"]))
        refused = await asyncio.wait_for(asyncio.gather(doomed, return_exceptions=True), 90)
        served = await client.act(calm, "job", [make_obs(FLOW, 1)], timeout=60)
        assert served.error == "" and served.actions is not None, served.error
        error = refused[0]
        assert isinstance(error, InferenceError) and not error.retryable, error
        assert "began 3 times in a row" in str(error), error
        assert proc.poll() is None, _text(log)
        assert _text(batches).split().count("load") == 4, _text(batches)
        dead = await dead_letters(js, "INFER", poison)
        assert [d.error_type for d in dead] == ["CrashLoopError"], dead


async def test_a_crash_beside_a_suspects_policy_load_is_not_charged_to_the_suspect(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """An innocent suspect's policy load runs beside a fresh request that kills the process.
    Before, that load counted as a start of the suspect, so the crash of the other request
    climbed its count, and the suspect was dead-lettered at the next start without ever
    having crashed anything on its own."""
    bid, killer, innocent = uid("besideload"), uid("killer"), uid("innocent")
    batches, log, marker = tmp_path / "batches", tmp_path / "inferencer.log", tmp_path / "held"
    hold = ["--hold-load", innocent, str(marker)]
    async with _policies(fresh_server.url, bid, killer, innocent) as (js, client):
        waiting = asyncio.create_task(client.act(innocent, "job", [make_obs(FLOW, 0)], timeout=240))
        # Two runs killed (SIGKILL: a host's OOM killer) while its policy loads: its first
        # delivery (not counted), then its first counted start. It is a suspect now.
        for _ in range(2):
            marker.unlink(missing_ok=True)
            proc = procs.add(_start(fresh_server.url, killer, batches, log, bid, hold))
            await eventually(marker.exists, timeout=90, what="the innocent's policy load")
            proc.kill()
            proc.wait(timeout=30)
        # The third loads its policy as a suspect's (held), while a fresh request of the
        # killer's is served beside it and kills the process.
        marker.unlink()
        proc = procs.add(_start(fresh_server.url, killer, batches, log, bid, hold))
        await eventually(marker.exists, timeout=90, what="the suspect's policy load")
        with pytest.raises(InferenceError):
            # It expires before the next start: nothing else crashes after this.
            await client.act(killer, "job", [make_obs(FLOW, 1)], timeout=10)
        await _crashes(proc, log)
        proc = procs.add(_start(fresh_server.url, killer, batches, log, bid))
        served = await asyncio.wait_for(waiting, 90)
        assert served.error == "" and served.actions is not None, served.error
        assert proc.poll() is None, _text(log)
        ran = [line.split() for line in batches.read_text().splitlines()]
        assert ran == [[killer], [innocent]], ran
        assert await dead_letters(js, "INFER", innocent) == []
