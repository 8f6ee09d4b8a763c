"""Fixtures: a real ``nats-server -js`` per session (and per test where a clean store is
needed), a connected client, and service subprocesses that are always reaped."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from bus.connect import connect
from bus.datacache import DatasetCache
from bus.declare import declare
from bus.server import EmbeddedServer
from clients.sdk import Client
from services.master.queries import Queries

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The roles compute with one intra-op thread (their --torch-threads default). On some CPUs
# (AVX-512 ones here) a matmul's bits depend on the thread count, so a reference computed in
# the test process must use one thread too, whichever test files a run selects.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """One JetStream server for the session; tests isolate by uuid tenant/job names."""
    server = EmbeddedServer(tmp_path_factory.mktemp("nats-session")).start()
    yield server
    server.stop()


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A JetStream server with an empty store, for tests that kill or inspect the server."""
    server = EmbeddedServer(tmp_path / "nats").start()
    yield server
    server.kill()


@pytest_asyncio.fixture
async def nc(nats_server: EmbeddedServer) -> AsyncIterator[NATS]:
    client = await connect(nats_server.url, name="pytest")
    yield client
    await client.close()


@pytest_asyncio.fixture
async def js(nc: NATS) -> JetStreamContext:
    ctx = nc.jetstream()
    await declare(ctx)
    return ctx


class Procs:
    """Child processes started by a test; SIGKILLed at teardown if still running."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def add(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout)


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    yield p
    for proc in p.procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest_asyncio.fixture
async def stack(fresh_server: EmbeddedServer, tmp_path: Path) -> AsyncIterator[tuple[NATS, Client]]:
    """The master's responders to tenants' requests (in process, no JOBS consumer) and a
    client, on a server of this test alone (the only responders in the ``master`` group)."""
    from clients.sdk import Client

    nc = await connect(fresh_server.url, name="pytest-master")
    js = nc.jetstream()
    await declare(js)
    queries = await Queries.on_bus(js, DatasetCache(tmp_path / "cache"))
    await queries.subscribe(nc)
    client = await Client.connect(fresh_server.url)
    yield nc, client
    await client.close()
    await queries.close()
    await nc.close()


@pytest.fixture(scope="session")
def maniskill_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty ManiSkill asset dir for the session (the vetted tasks need no assets, and
    nothing may be downloaded into it). ManiSkill reads ``MS_ASSET_DIR`` once, at its first
    import in a process, so one dir serves every test here and the services they start.
    ``MS_SKIP_ASSET_DOWNLOAD_PROMPT`` is unset: ManiSkill's download prompt then reads stdin
    (at EOF in our calls) instead of answering "yes", so a refusal we failed to make cannot
    turn into a download."""
    asset_dir = tmp_path_factory.mktemp("maniskill-assets")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MS_ASSET_DIR", str(asset_dir))
        mp.delenv("MS_SKIP_ASSET_DOWNLOAD_PROMPT", raising=False)
        yield asset_dir
