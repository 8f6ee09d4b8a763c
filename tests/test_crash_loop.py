"""A message that kills the process handling it is dead-lettered after the consumer's
``max_crashes`` deliveries in a row died, counted in the crash ledger (:mod:`bus.crashes`)
apart from the server's delivery counter — which the test rolls back (the consumer deleted
and created again: its redeliveries start at ``num_delivered == 1``, as after a broker crash
that lost the consumer's state), and the count survives it. The process is a real one that
dies without settling anything (``os._exit``), restarted by the test as a supervisor would."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from bus.codec import decode
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.dead import DEAD_LETTER_DECODER, DeadLetter
from tests.conftest import Procs
from tests.helpers import ROOT, eventually, service_env, uid

MAX_CRASHES = 2
CRASHED = 3  # the consumer's exit status when it dies on the poison


async def _dead_letters(js: JetStreamContext, tenant: str) -> list[DeadLetter]:
    sub = await js.subscribe(subjects.dead("TRAIN", tenant), ordered_consumer=True)
    found = []
    try:
        while True:
            found.append(decode(DEAD_LETTER_DECODER, (await sub.next_msg(timeout=0.5)).data))
    except NatsError:  # no more records
        return found
    finally:
        await sub.unsubscribe()


def _start(url: str, durable: str, subject: str, out: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tests.crashing_consumer", url, durable, subject]
    with log.open("ab") as f:
        return subprocess.Popen(
            [*argv, str(MAX_CRASHES), str(out)],
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
            if len(handled) == 3 and await _dead_letters(js, tenant):
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
    dead = await eventually(lambda: _dead_letters(js, tenant), what="the poison's dead letter")
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
