"""Env workers hold simulator sessions ready when asked (``nexus.ctl.envs.prewarm``): every
worker answers, builds what is missing, and says why when it cannot."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus.codec import decode, encode
from bus.connect import connect
from bus.kv import kv_values
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.envctl import PREWARMED_DECODER, EnvPrewarmed, PrewarmEnv
from schemas.health import HEARTBEAT_DECODER
from services.envs.sims import REACH2D_ID
from tests.conftest import Procs
from tests.helpers import eventually, start_service


async def ask(nc: NATS, payload: bytes, workers: int, timeout: float = 60.0) -> list[EnvPrewarmed]:
    """Publish one prewarm request; collect ``workers`` answers."""
    answers: asyncio.Queue[EnvPrewarmed] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        await answers.put(decode(PREWARMED_DECODER, msg.data))

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=collect)
    try:
        await nc.publish(subjects.ENVS_PREWARM, payload, reply=inbox)
        return [await asyncio.wait_for(answers.get(), timeout) for _ in range(workers)]
    finally:
        await sub.unsubscribe()


async def test_every_worker_builds_the_sessions_asked_for_and_refuses_what_it_cannot(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    for i in range(2):
        procs.add(start_service("envs", fresh_server.url, tmp_path / f"envs-{i}.log"))
    nc = await connect(fresh_server.url)
    try:
        js = nc.jetstream()

        async def workers_up() -> bool:
            try:
                return len(await kv_values(js, subjects.KV_HEARTBEATS, "envs.")) == 2
            except Exception:  # noqa: BLE001 - the bucket is declared by the first worker
                return False

        await eventually(workers_up, timeout=60, what="two env workers heartbeating")
        request = PrewarmEnv(REACH2D_ID, 3, image_size=32, max_episode_steps=20)
        first = await ask(nc, encode(request), 2)
        assert len({a.instance for a in first}) == 2
        assert all((a.idle, a.built, a.error) == (3, 3, "") for a in first), first
        again = await ask(nc, encode(request), 2)
        assert all((a.idle, a.built) == (3, 0) for a in again), again  # nothing rebuilt

        async def gauged() -> bool:
            beats = await kv_values(js, subjects.KV_HEARTBEATS, "envs.")
            gauges = [decode(HEARTBEAT_DECODER, v).gauges for v in beats.values()]
            return all(g.get(f"env.{REACH2D_ID}.sessions") == 3.0 for g in gauges)

        await eventually(gauged, timeout=10, what="the sessions in the workers' gauges")

        refused = await ask(nc, encode(PrewarmEnv(REACH2D_ID, 0)), 2)
        assert all("sessions: 0" in a.error for a in refused), refused
        unknown = await ask(nc, encode(PrewarmEnv("JoyNexus/Nowhere-v9", 1)), 2)
        assert all("Nowhere-v9" in a.error and a.built == 0 for a in unknown), unknown
        garbled = await ask(nc, b"\x93not a request", 2)
        assert all(a.error.startswith("malformed") for a in garbled), garbled
    finally:
        await nc.close()


async def test_a_worker_says_it_is_building_before_a_build_can_hold_its_heartbeat_up(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """A simulator's first build can hold the GIL for 10-30 s, and the heartbeat loop with
    it: the worker publishes a heartbeat saying it is building as the build starts (not at
    its next tick, here a minute away), so the health manager gives it the longer grace."""
    procs.add(
        start_service(
            "envs", fresh_server.url, tmp_path / "envs.log", JOYNEXUS_HEARTBEAT_INTERVAL_S="60"
        )
    )
    nc = await connect(fresh_server.url)
    beats: list[str] = []

    async def collect(msg: Msg) -> None:
        beats.append(decode(HEARTBEAT_DECODER, msg.data).busy_with)

    try:
        js = nc.jetstream()

        async def up() -> bool:
            try:
                return bool(await kv_values(js, subjects.KV_HEARTBEATS, "envs."))
            except Exception:  # noqa: BLE001 - the bucket is declared by the worker
                return False

        await eventually(up, timeout=60, what="the worker's first heartbeat")
        # From here on its heartbeat loop is a minute from its next tick.
        await nc.subscribe(f"$KV.{subjects.KV_HEARTBEATS}.envs.>", cb=collect)
        await nc.flush()
        request = PrewarmEnv(REACH2D_ID, 1, image_size=32, max_episode_steps=20)
        (answer,) = await ask(nc, encode(request), 1)
        assert (answer.built, answer.error) == (1, "")
        assert beats == ["building 1 simulator session(s)"], beats
    finally:
        await nc.close()
