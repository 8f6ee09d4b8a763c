"""A message that kills the process handling it is dead-lettered after the consumer's
``max_crashes`` deliveries in a row died, counted in the crash ledger (:mod:`bus.crashes`)
apart from the server's delivery counter — which the test rolls back (the consumer deleted
and created again: its redeliveries start at ``num_delivered == 1``, as after a broker crash
that lost the consumer's state), and the count survives it. The process is a real one that
dies without settling anything (``os._exit``), restarted by the test as a supervisor would."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from bus.connect import connect
from bus.crashes import CrashLedger
from bus.server import EmbeddedServer, free_port
from schemas import subjects
from tests.conftest import Procs
from tests.helpers import ROOT, dead_letters, eventually, server_without_jetstream, service_env, uid

MAX_CRASHES = 2
CRASHED = 3  # the consumer's exit status when it dies on the poison


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _start(
    url: str, durable: str, subject: str, out: Path, log: Path, concurrency: int = 1
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tests.crashing_consumer", url, durable, subject]
    with log.open("ab") as f:
        return subprocess.Popen(
            [*argv, str(MAX_CRASHES), str(out), str(concurrency)],
            cwd=ROOT,
            env=service_env(url),
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


async def test_a_message_that_kills_its_handler_is_dead_lettered_though_delivery_counts_roll_back(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    tenant, durable = uid("crash"), uid("c")
    subject = subjects.train("tiny", tenant)
    out, log = tmp_path / "handled", tmp_path / "consumer.log"
    poison = await js.publish(subject, b"crash")
    for i in range(3):
        await js.publish(subject, f"ok-{i}".encode())

    crashes, rolled_back = 0, False
    for _ in range(8):  # bounded: 4 crashes are expected, then one run that carries on
        proc = procs.add(_start(nats_server.url, durable, subject, out, log))
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            handled = out.read_text().split() if out.exists() else []
            if len(handled) == 3 and await dead_letters(js, "TRAIN", tenant):
                break
            await asyncio.sleep(0.05)  # polling a child process; it sends no event
        if proc.poll() is None:
            break
        assert proc.returncode == CRASHED, log.read_text()
        crashes += 1
        if crashes == MAX_CRASHES and not rolled_back:
            # The server forgets the deliveries: its next one says num_delivered == 1.
            await js.delete_consumer("TRAIN", durable)
            rolled_back = True

    # Two crashes, the roll-back, the uncounted first delivery's crash, one more: the ledger
    # had counted 1 before the roll-back, so the third counted start is past MAX_CRASHES.
    assert crashes == 4, log.read_text()
    assert sorted(out.read_text().split()) == ["ok-0", "ok-1", "ok-2"]
    dead = await eventually(
        lambda: dead_letters(js, "TRAIN", tenant), what="the poison's dead letter"
    )
    assert [d.stream_seq for d in dead] == [poison.seq]
    assert dead[0].error_type == "CrashLoopError"
    # The server's count says 3, and 3 <= max_deliver: only the ledger saw this loop's end.
    assert "began 3 times in a row" in dead[0].reason and dead[0].num_delivered == 3
    kv = await js.key_value(subjects.KV_CRASHES)
    try:
        entry = await kv.get(f"TRAIN.{durable}.{poison.seq}")
        raise AssertionError(f"the ledger still counts the dead message: {entry.value!r}")
    except (KeyNotFoundError, KeyDeletedError):
        pass
    assert procs.stop(proc) == 0


async def test_a_message_in_flight_beside_the_poison_is_handled_not_dead_lettered(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """A consumer handling two at once (as env workers do): every crash counted the innocent
    message in flight beside the poison too, and both were dead-lettered together. A message
    with a count already now runs alone, counted only then."""
    tenant, durable = uid("crash"), uid("c")
    subject = subjects.train("tiny", tenant)
    out, log = tmp_path / "handled", tmp_path / "consumer.log"
    await js.publish(subject, b"slow-innocent")
    poison = await js.publish(subject, b"crash")
    crashes = 0
    for _ in range(8):  # bounded: a few crashes, then a run that carries on
        proc = procs.add(_start(nats_server.url, durable, subject, out, log, concurrency=2))
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            handled = out.read_text().split() if out.exists() else []
            if handled and await dead_letters(js, "TRAIN", tenant):
                break
            await asyncio.sleep(0.05)  # polling a child process; it sends no event
        if proc.poll() is None:
            break
        assert proc.returncode == CRASHED, log.read_text()
        crashes += 1
    assert out.read_text().split() == ["slow-innocent"], log.read_text()
    dead = await eventually(
        lambda: dead_letters(js, "TRAIN", tenant), what="the poison's dead letter"
    )
    assert [d.stream_seq for d in dead] == [poison.seq], crashes
    assert procs.stop(proc) == 0


async def test_the_ledger_counts_nothing_but_carries_on_when_jetstream_does_not_answer(
    procs: Procs, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding the ledger's bucket is a JetStream API request; while a cluster elects a new
    leader it times out (seen: an env worker died of it when a node was killed). Counting is a
    guard, not a gate: the redelivered message is handled uncounted and the consumer lives.
    Here the server has no JetStream at all, so every API request fails."""
    port = free_port()
    procs.add(server_without_jetstream(port))
    await eventually(lambda: _listening(port), what="the server listening")
    nc = await connect(f"nats://127.0.0.1:{port}")
    try:
        ledger = CrashLedger(nc.jetstream(timeout=0.5))
        # A second delivery of stream seq 7 to consumer c of TRAIN, as its reply subject says.
        redelivered = Msg(nc, subject="s", reply="$JS.ACK.TRAIN.c.2.7.7.1700000000000000000.0")
        assert redelivered.metadata.num_delivered == 2
        with caplog.at_level(logging.WARNING, logger="bus.crashes"):
            assert await ledger.begin(redelivered) == 0
            assert await ledger.begin(redelivered) == 0  # looked for again, not given up on
        assert sum("could not count TRAIN.c.7" in r.getMessage() for r in caplog.records) == 2
        await ledger.end(redelivered)  # nothing was written: nothing to clear, no error
    finally:
        await nc.close()


class _FlakyBucket:
    """The ledger's real bucket, whose every operation times out while ``down`` is set (as
    while a cluster elects a new leader)."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self.down = False

    def __getattr__(self, name: str) -> Callable[..., Awaitable[object]]:
        operation = getattr(self.kv, name)

        async def call(*args: object, **kwargs: object) -> object:
            if self.down:
                raise TimeoutError(f"{name}: no answer")
            return await operation(*args, **kwargs)

        return call


async def test_a_start_is_taken_back_once_and_only_if_it_was_counted(js: JetStreamContext) -> None:
    """Two crashes counted before (by a process that died): a start this process counts and
    takes back leaves them; a start the ledger could not count (its bucket away) is not
    taken back when its work returns, which would erase one of the crashes; nor is one start
    taken back twice."""
    consumer = uid("c")
    kv = await js.key_value(subjects.KV_CRASHES)
    ledger = CrashLedger(js)
    flaky = _FlakyBucket(kv)
    ledger._kv = flaky  # type: ignore[assignment]
    msg = Msg(js._nc, subject="s", reply=f"$JS.ACK.TRAIN.{consumer}.3.7.7.1700000000000000000.0")
    key = f"TRAIN.{consumer}.7"

    async def count() -> int:
        try:
            return int((await kv.get(key)).value or b"0")
        except (KeyNotFoundError, KeyDeletedError):
            return 0

    await kv.put(key, b"2")
    assert await ledger.begin(msg) == 3
    await ledger.undo(msg)
    assert await count() == 2
    flaky.down = True
    assert await ledger.begin(msg) == 0  # handled uncounted
    flaky.down = False
    await ledger.undo(msg)
    assert await count() == 2
    assert await ledger.begin(msg) == 3
    await ledger.undo(msg)
    await ledger.undo(msg)
    assert await count() == 2
    assert await ledger.begin(msg) == 3
    flaky.down = True
    await ledger.undo(msg)  # cannot be written: the start stays counted, never less
    flaky.down = False
    assert await count() == 3
    await ledger.end(msg)
    assert await count() == 0


async def test_a_message_handed_back_keeps_the_crashes_counted_before_its_start(
    js: JetStreamContext,
) -> None:
    """A graceful stop (a scale-down) hands a started message back: its start is taken back,
    but the crashes it was in flight for stay counted for the next instance; before, the
    hand-back cleared them, so a poison's count started again at every scale-down."""
    consumer = uid("c")
    kv = await js.key_value(subjects.KV_CRASHES)
    ledger = CrashLedger(js)
    msg = Msg(js._nc, subject="s", reply=f"$JS.ACK.TRAIN.{consumer}.3.9.9.1700000000000000000.0")
    key = f"TRAIN.{consumer}.9"
    await kv.put(key, b"2")
    assert await ledger.begin(msg) == 3
    await ledger.handed_back(msg)
    assert int((await kv.get(key)).value or b"0") == 2
    await ledger.end(msg)  # settled elsewhere later: not this process's key to clear now
    assert int((await kv.get(key)).value or b"0") == 2
    other = CrashLedger(js)  # the next instance counts on from the crashes
    assert await other.begin(msg) == 3
