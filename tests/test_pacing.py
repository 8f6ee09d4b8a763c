"""What keeps one tenant's flood of requests from taking the master from others: per-tenant
pacing (:mod:`services.master.pacing`) — the token arithmetic, and on a real bus a tenant
asking in closed loops slowed to its rate while another tenant's requests never wait and
every request is answered — and act requests no policy could serve refused by the master
before they cost INFER and an inferencer anything."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS

from bus.connect import connect
from bus.datacache import DatasetCache
from bus.declare import declare
from bus.inference import observation
from bus.server import EmbeddedServer
from clients.errors import RequestError
from clients.sdk import Client
from schemas import subjects
from schemas.model import Observation
from schemas.tenantctl import JobsReply, ListJobs, SamplePolicy
from services.master.pacing import BYTES_PER_TOKEN, Pacer
from services.master.queries import Queries
from tests.helpers import uid


def test_a_burst_goes_at_once_and_the_rest_waits_its_turn_at_the_rate() -> None:
    pacer = Pacer(rate=10.0, burst=3.0)
    waits = [pacer.reserve("a", now=100.0) for _ in range(5)]
    assert waits[:3] == [0.0, 0.0, 0.0]
    assert waits[3:] == pytest.approx([0.1, 0.2])
    assert pacer.reserve("b", now=100.0) == 0.0  # another tenant has its own bucket
    assert pacer.paced == {"a": 2}
    # Two tokens were owed at t=100; after 1 s ten more came: the burst is full again.
    assert [pacer.reserve("a", now=101.0) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_large_requests_cost_a_token_per_bytes_per_token() -> None:
    pacer = Pacer(rate=10.0, burst=5.0)
    assert pacer.reserve("a", size=4 * BYTES_PER_TOKEN, now=0.0) == 0.0  # 5 tokens
    assert pacer.reserve("a", size=0, now=0.0) == pytest.approx(0.1)


def test_rate_zero_is_unpaced() -> None:
    pacer = Pacer(rate=0.0, burst=1.0)
    assert all(pacer.reserve("a", now=0.0) == 0.0 for _ in range(1000))


@pytest_asyncio.fixture
async def paced(fresh_server: EmbeddedServer, tmp_path: Path) -> AsyncIterator[Queries]:
    nc = await connect(fresh_server.url, name="pytest-master")
    await declare(nc.jetstream())
    queries = Queries(
        nc.jetstream(),
        await nc.jetstream().key_value("jobs"),
        await nc.jetstream().key_value("policies"),
        DatasetCache(tmp_path / "cache"),
        pacer=Pacer(rate=20.0, burst=5.0),
    )
    await queries.subscribe(nc)
    yield queries
    await queries.close()
    await nc.close()


async def test_a_flooding_tenant_is_slowed_to_its_rate_and_another_never_waits(
    paced: Queries, fresh_server: EmbeddedServer
) -> None:
    flooder, calm = uid("flood"), uid("calm")
    flooding = calm_answers = 0
    async with await Client.connect(fresh_server.url) as client:

        async def flood_loop() -> None:
            nonlocal flooding
            for _ in range(8):
                assert isinstance(await client.request(flooder, ListJobs(flooder)), JobsReply)
                flooding += 1

        async def calm_loop() -> None:
            nonlocal calm_answers
            for _ in range(4):  # within its burst, spread out
                assert isinstance(await client.request(calm, ListJobs(calm)), JobsReply)
                calm_answers += 1
                await asyncio.sleep(0.3)  # a client's own pace between its requests

        started = time.monotonic()
        await asyncio.gather(*(flood_loop() for _ in range(8)), calm_loop())
        elapsed = time.monotonic() - started
    assert (flooding, calm_answers) == (64, 4)  # every request answered
    # 64 requests at 20/s after a burst of 5 cannot take less than (64 - 5) / 20 s.
    assert elapsed >= (64 - 5) / 20 - 0.05
    assert paced.pacer.paced[flooder] >= 64 - 5 - 1
    assert calm not in paced.pacer.paced


async def test_the_master_refuses_an_act_no_policy_could_serve_before_relaying_it(
    stack: tuple[NATS, Client],
) -> None:
    """Oversize images, NaN proprio and too many observations are refused by the master
    (naming the field and the limit) without a write to INFER; a well-formed request goes on
    to the policy lookup (here: no such job)."""
    nc, client = stack
    tenant = uid("acme")
    rng = np.random.default_rng(0)

    def obs(side: int = 32, proprio: float = 0.0) -> Observation:
        image = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        return observation([image], "reach", np.full(4, proprio, np.float32))

    async def act(observations: list[Observation]) -> RequestError:
        with pytest.raises(RequestError) as refused:
            await client.request(tenant, SamplePolicy(tenant, "j", observations, 0, True, 0, 5.0))
        return refused.value

    infer = await nc.jetstream().stream_info(subjects.STREAM_INFER)
    big = await act([obs(), obs(side=520)])
    assert (
        big.code == "invalid"
        and "observations[1].images[0]: 520x520 exceeds max_image_side 512" in str(big)
    )
    nan = await act([obs(proprio=float("nan"))])
    assert nan.code == "invalid" and "observations[0].proprio: 4 of 4 values are NaN" in str(nan)
    many = await act([obs(side=8)] * 257)
    assert many.code == "invalid" and "observations: 257 exceeds max_observations 256" in str(many)
    assert (await act([obs()])).code == "not_found"
    after = await nc.jetstream().stream_info(subjects.STREAM_INFER)
    assert after.state.last_seq == infer.state.last_seq
