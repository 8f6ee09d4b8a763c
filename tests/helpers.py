"""Test helpers: eventually(), unique names, service subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar, overload

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from bus.codec import decode
from bus.server import nats_server_binary
from schemas import subjects
from schemas.dead import DEAD_LETTER_DECODER, DeadLetter

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


def uid(prefix: str = "t") -> str:
    """A unique, subject-safe id for one test."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@overload
async def eventually(
    probe: Callable[[], Awaitable[T | None]],
    timeout: float = ...,
    interval: float = ...,
    what: str = ...,
) -> T: ...
@overload
async def eventually(
    probe: Callable[[], T | None],
    timeout: float = ...,
    interval: float = ...,
    what: str = ...,
) -> T: ...
async def eventually(
    probe: Callable[[], Awaitable[T | None]] | Callable[[], T | None],
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        result = probe()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result  # type: ignore[return-value]
        last = result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s (last: {last!r})")
        await asyncio.sleep(interval)


def service_env(url: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(JOYNEXUS_URL=url, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def start_service(
    role: str, url: str, log_path: Path, *args: str, **env: str
) -> subprocess.Popen[bytes]:
    """``python -m services.<role>`` as a child process logging to ``log_path``."""
    with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", f"services.{role}", *args],
            cwd=ROOT,
            env=service_env(url, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def catches_sigterm(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the process has a SIGTERM handler (``SigCgt`` in /proc). Until its first
    line (``install_early``) runs, ~50 ms after exec, a SIGTERM kills it like any process:
    no code of ours can see that one, so the test does not count it as a stop."""
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except FileNotFoundError:
        return proc.poll() is not None
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def print_log_tails(logs: Path, lines: int = 40) -> None:
    """Print the last ``lines`` of every log under ``logs`` (pytest shows them with a failure:
    a stack test's roles are separate processes whose logs die with its temp dir)."""
    for path in sorted(logs.rglob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"----- {path.relative_to(logs)} (last {len(tail)} lines)")
        print("\n".join(tail))


def server_without_jetstream(port: int) -> subprocess.Popen[bytes]:
    """A plain nats-server on ``port``: every JetStream API request to it fails."""
    return subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def joynexus(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """``joynexus ARGS`` (``python -m bench.cli``) in a worker thread; its output captured."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "bench.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


async def dead_letters(js: JetStreamContext, stream: str, tenant: str) -> list[DeadLetter]:
    """Every dead letter of ``tenant`` from ``stream`` so far."""
    sub = await js.subscribe(subjects.dead(stream, tenant), ordered_consumer=True)
    found = []
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            found.append(decode(DEAD_LETTER_DECODER, msg.data))
    except NatsError:  # no more records
        return found
    finally:
        await sub.unsubscribe()
