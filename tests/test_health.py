"""The health manager acts: a dead or stalled instance is restarted alone, in place, within
a budget; a role busy with a long operation is left alone; an instance told to restart exits
75 for its supervisor."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, cast

import pytest
from nats.aio.msg import Msg

from bus.codec import decode, encode
from bus.connect import connect
from bus.kv import kv_values
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.health import (
    HEALTH_REPORT_DECODER,
    HEALTH_SUBJECT,
    HEARTBEAT_DECODER,
    OPS_EVENT_DECODER,
    OPS_SUBJECT,
    Heartbeat,
    OpsEvent,
    RestartOrder,
    restart_subject,
)
from services.health.service import (
    HealthConfig,
    HealthManager,
    LivenessTable,
    OwnView,
    Restarts,
)
from services.launcher import LocalStack
from tests.conftest import Procs
from tests.helpers import eventually, start_service


def beat(at: float, progress: int = 0, in_flight: int = 0, busy_with: str = "") -> Heartbeat:
    return Heartbeat(
        "envs", "envs-a", 1, "h", 0.0, at, "v", in_flight, progress=progress, busy_with=busy_with
    )


def test_dead_stalled_and_busy_instances_are_told_apart() -> None:
    table = LivenessTable(stale_after_s=3.0, stall_after_s=10.0)
    table.observe("a", beat(100.0, progress=5, in_flight=2), heard_at=100.0)
    assert table.state("a", 101.0) == "alive"
    assert table.state("a", 104.0) == "dead"  # no heartbeat for 4 s
    # Heartbeating, work in flight, no progress for 11 s: stalled.
    table.observe("a", beat(111.0, progress=5, in_flight=2), heard_at=111.0)
    assert table.state("a", 111.5) == "stalled"
    # The same while it says what holds it up (a simulator build): not a stall.
    table.observe(
        "a", beat(112.0, progress=5, in_flight=2, busy_with="building 1 session"), heard_at=112.0
    )
    assert table.state("a", 112.5) == "alive"
    # Idle (nothing in flight) for long: alive.
    table.observe("b", beat(100.0, progress=1), heard_at=100.0)
    table.observe("b", beat(200.0, progress=1), heard_at=200.0)
    assert table.state("b", 200.5) == "alive"
    # Progress moving: alive.
    table.observe("a", beat(113.0, progress=6, in_flight=2), heard_at=113.0)
    assert table.state("a", 113.5) == "alive"
    table.observe("a", None)  # a clean stop deletes the key
    assert "a" not in table.seen


def test_an_instance_idle_or_busy_for_long_is_not_stalled_as_soon_as_work_comes() -> None:
    """Only time with work in hand and no progress is a stall: an instance idle for minutes
    that gets work, or one whose long build just ended, starts a new stall clock."""
    table = LivenessTable(stale_after_s=3.0, stall_after_s=10.0)
    table.observe("a", beat(100.0, progress=5), heard_at=100.0)
    table.observe("a", beat(300.0, progress=5), heard_at=300.0)  # idle for 200 s
    table.observe("a", beat(301.0, progress=5, in_flight=1), heard_at=301.0)  # work came in
    assert table.state("a", 301.5) == "alive"
    table.observe("a", beat(310.0, progress=5, in_flight=1), heard_at=310.0)
    assert table.state("a", 310.5) == "alive"
    table.observe(
        "a", beat(312.0, progress=5, in_flight=1), heard_at=312.0
    )  # 11 s with work, no progress
    assert table.state("a", 312.5) == "stalled"
    table.observe("b", beat(100.0, progress=1, in_flight=1, busy_with="building"), heard_at=100.0)
    table.observe("b", beat(200.0, progress=1, in_flight=1, busy_with="building"), heard_at=200.0)
    table.observe("b", beat(201.0, progress=1, in_flight=1), heard_at=201.0)  # the build ended
    assert table.state("b", 201.5) == "alive"


def test_liveness_is_judged_by_the_managers_clock_not_the_senders() -> None:
    """Roles on other hosts write their own clock into their heartbeats: a sender 30 s behind
    is alive while its heartbeats come, one 30 s ahead is dead 3 s after its last one was
    heard, and a stall is timed from when the beats were heard."""
    table = LivenessTable(stale_after_s=3.0, stall_after_s=10.0)
    table.observe("behind", beat(970.0, progress=1, in_flight=1), heard_at=1000.0)
    table.observe("ahead", beat(1030.0), heard_at=1000.0)
    assert table.state("behind", 1001.0) == "alive"
    assert table.state("ahead", 1004.0) == "dead"
    table.observe("behind", beat(981.5, progress=1, in_flight=1), heard_at=1011.0)
    assert table.state("behind", 1011.0) == "stalled"  # 11 s heard with work, no progress
    assert table.report(1012.0, {}, []).instances[0].age_s == 1.0
    # A restarted watch replays the same entry: no news, its time stays.
    table.observe("ahead", beat(1030.0), heard_at=2000.0)
    assert table.state("ahead", 2000.0) == "dead"
    # Heard with no time given (an entry the watch replays as it starts): heard now,
    # whatever the sender's clock says; silent from then on, it is dead 3 s later.
    table.observe("behind", beat(time.time() - 60.0))
    assert table.state("behind", time.time()) == "alive"
    assert table.state("behind", time.time() + 4.0) == "dead"


def test_the_manager_times_a_beat_from_when_it_hears_it_replayed_or_not() -> None:
    """At the manager's start its watch replays the bucket: a sender 20 s behind, timed by
    its own clock, would be found dead (or stalled by the skew) at the first look."""
    from nats.js.kv import KeyValue

    manager = HealthManager.__new__(HealthManager)
    manager.table = LivenessTable(3.0, 10.0)

    def entry(key: str, at: float) -> KeyValue.Entry:
        return KeyValue.Entry("heartbeats", key, encode(beat(at, in_flight=1)), 1, 5, None, None)

    manager.observe(entry("a", time.time() - 20.0))  # replayed
    assert manager.table.state("a", time.time()) == "alive"
    manager.observe(entry("a", time.time() - 19.0))  # live, no progress: not a 20 s stall
    assert manager.table.state("a", time.time()) == "alive"


def test_a_silent_instance_that_said_it_was_building_gets_longer_before_a_restart() -> None:
    """A simulator's native build can hold the GIL, and the heartbeat with it: an instance
    whose last heartbeat said it was building is left silent for busy_restart_after_s."""
    config = HealthConfig(restart_after_s=15.0, busy_restart_after_s=60.0)
    assert config.dead_after_s(beat(0.0)) == 15.0
    assert config.dead_after_s(beat(0.0, busy_with="building 2 simulator session(s)")) == 60.0
    assert HealthConfig(restart_after_s=90.0).dead_after_s(beat(0.0, busy_with="x")) == 90.0


def test_the_health_manager_does_not_act_on_a_view_its_own_outage_made_stale() -> None:
    """After its own connection dropped (a broker restart, its cluster node killed), every
    heartbeat looks old: it waits ``settle_s`` of renewed view before declaring anyone dead."""
    view = OwnView(settle_s=15.0, stale_s=3.0)
    assert view.acting(True, 0, 100.0, own_beat_at=99.5)
    assert not view.acting(False, 0, 101.0, own_beat_at=100.5)  # disconnected
    assert not view.acting(True, 1, 103.0, own_beat_at=102.5)  # reconnected: renewing
    assert not view.acting(True, 1, 117.9, own_beat_at=117.5)
    assert view.acting(True, 1, 118.1, own_beat_at=117.5)  # 15 s after it was disconnected
    assert not view.acting(True, 2, 130.0, own_beat_at=129.5)  # a reconnect it did not see


def test_the_health_manager_does_not_act_while_its_own_heartbeat_looks_old() -> None:
    """Connected, but the heartbeats bucket or its watch stopped (a stream leader election,
    API timeouts): its own heartbeat, written every second, stops coming too, and every
    instance would look dead. It acts only while its own heartbeat is current."""
    view = OwnView(settle_s=15.0, stale_s=3.0)
    assert view.acting(True, 0, 100.0, own_beat_at=99.5)
    assert not view.acting(True, 0, 104.0, own_beat_at=100.5)  # 3.5 s old
    assert not view.acting(True, 0, 100.0, own_beat_at=None)  # not seen yet (starting)
    assert view.acting(True, 0, 105.0, own_beat_at=104.5)  # seen again


def test_a_spent_restart_budget_is_reported_once_while_another_instance_of_the_role_lives() -> None:
    """A role with a live instance and a dead one whose budget is spent: one
    ``budget_exhausted`` event, not one per tick (the live instance's tick re-armed it)."""
    from types import SimpleNamespace

    config = HealthConfig(restart_budget=0)
    events: list[str] = []
    manager = HealthManager.__new__(HealthManager)
    manager.config = config
    manager.table = LivenessTable(config.stale_after_s, config.stall_after_s)
    manager.restarts = Restarts(0, config.budget_window_s, config.backoff_s)
    manager.exhausted = set()
    manager.view = OwnView(0.0, config.stale_after_s)
    nc = SimpleNamespace(is_connected=True, stats={"reconnects": 0})
    manager.rt = cast(Any, SimpleNamespace(nc=nc, instance="health-x"))

    async def emit(kind: str, beat: Heartbeat, reason: str) -> None:
        events.append(kind)

    manager.emit = emit  # type: ignore[method-assign]
    now = time.time()

    def role_beat(instance: str, at: float, host: str = "elsewhere") -> Heartbeat:
        return Heartbeat("envs", instance, 1, host, 0.0, at, "v", 0)

    async def ticks() -> None:
        for i in range(5):
            t = now + i
            manager.table.observe("envs.live", role_beat("envs-live", t), heard_at=t)
            manager.table.observe(
                "health.x", Heartbeat("health", "health-x", 2, "h", 0.0, t, "v", 0), heard_at=t
            )
            await manager.tick(t + 0.5)

    manager.table.observe("envs.dead", role_beat("envs-dead", now - 100.0), heard_at=now - 100.0)
    asyncio.run(ticks())
    assert events == ["budget_exhausted"]


def test_restarts_keep_to_the_budget_with_a_doubling_backoff() -> None:
    policy = Restarts(budget=3, window_s=100.0, backoff_s=5.0)
    assert policy.decide("envs", 0.0) == "restart"
    policy.record("envs", 0.0)
    assert policy.decide("envs", 4.0) == "wait"  # within 5 s of the last
    assert policy.decide("envs", 6.0) == "restart"
    policy.record("envs", 6.0)
    assert policy.decide("envs", 15.0) == "wait"  # the second waits 10 s
    assert policy.decide("trainer", 15.0) == "restart"  # other roles are their own
    policy.record("envs", 17.0)
    assert policy.decide("envs", 60.0) == "exhausted"  # three within the window
    assert policy.decide("envs", 101.0) == "restart"  # the first fell out of the window
    assert policy.total == {"envs": 3}


async def test_a_restart_order_stops_a_role_cleanly_with_exit_75(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    proc = procs.add(start_service("master", fresh_server.url, tmp_path / "master.log"))
    nc = await connect(fresh_server.url)
    try:

        async def instance() -> str | None:
            try:
                beats = await kv_values(nc.jetstream(), subjects.KV_HEARTBEATS, "master.")
            except Exception:  # noqa: BLE001 - the bucket is declared by the master
                return None
            return next((decode(HEARTBEAT_DECODER, v).instance for v in beats.values()), None)

        name = await eventually(instance, timeout=30, what="the master's heartbeat")
        await nc.publish(restart_subject(name), encode(RestartOrder(name, "test")))
        assert await asyncio.to_thread(proc.wait, 15) == 75
    finally:
        await nc.close()


@pytest.mark.timeout(120)
def test_a_frozen_env_worker_is_killed_and_restarted_in_place(tmp_path: Path) -> None:
    """An env worker whose event loop blocks (fault injection: no heartbeat, no work) is
    found dead, told to exit, killed when it does not, and started again by the launcher;
    the other roles are not touched."""
    marker = tmp_path / "hung"
    stack = LocalStack(
        tmp_path / "home",
        roles={"health": 1, "envs": 1, "master": 1},
        auth=False,
        tenants=(),
        role_args={
            "envs": ["--hang-after-s", "3", "--hang-marker", str(marker)],
            "health": ["--restart-after-s", "3", "--grace-s", "1", "--backoff-s", "1"],
        },
    )
    try:
        info = stack.start_server()
        stack.start_roles()
        envs = next(c for c in stack.children if c.role == "envs")
        master = next(c for c in stack.children if c.role == "master")
        assert envs.proc is not None and master.proc is not None
        frozen_pid, master_pid = envs.proc.pid, master.proc.pid
        with stack.supervising():
            asyncio.run(watch_the_restart(info.url, info.user, info.password, frozen_pid))
        assert marker.read_text() == str(frozen_pid)  # it did freeze
        assert envs.restarts == 1  # and the restarted one stays up
        with pytest.raises(ProcessLookupError):
            os.kill(frozen_pid, 0)  # the frozen one is gone
        assert master.restarts == 0 and master.proc.pid == master_pid  # only that instance
        table = json.loads((tmp_path / "home" / "processes.json").read_text())
        assert table["envs"] == [envs.proc.pid] != [frozen_pid]  # the live pid, not the dead
    finally:
        stack.stop()


async def watch_the_restart(url: str, user: str | None, password: str | None, pid: int) -> None:
    nc = await connect(url, user=user, password=password)
    try:
        events: list[OpsEvent] = []

        async def collect(msg: Msg) -> None:
            events.append(decode(OPS_EVENT_DECODER, msg.data))

        await nc.subscribe(OPS_SUBJECT, cb=collect)

        async def restarted() -> OpsEvent | None:
            return next((e for e in events if e.kind == "restart" and e.role == "envs"), None)

        event = await eventually(restarted, timeout=60, what="the health manager's restart")
        assert event.pid == pid and "no heartbeat" in event.reason

        async def back() -> int | None:
            beats = await kv_values(nc.jetstream(), subjects.KV_HEARTBEATS, "envs.")
            fresh = [decode(HEARTBEAT_DECODER, v) for v in beats.values()]
            new = [b.pid for b in fresh if b.pid != pid and time.time() - b.at < 2]
            return new[0] if new else None

        await eventually(back, timeout=60, what="a new env worker heartbeating")
        msg = await nc.request(HEALTH_SUBJECT, b"", timeout=2)
        report = decode(HEALTH_REPORT_DECODER, msg.data)
        assert report.restarts == {"envs": 1}
        assert [e.instance for e in report.events] == [event.instance]
    finally:
        await nc.close()


def test_the_kill_grace_outlasts_a_roles_own_stop_deadline() -> None:
    """A role told to restart stops cleanly within its stop deadline: it is not killed
    before that could end."""
    from bus.service import STOP_DEADLINE_S

    assert HealthConfig().grace_s > STOP_DEADLINE_S


async def test_queue_reports_of_instances_gone_are_dropped() -> None:
    """Every restart is a new instance: the reports kept are the current ones only."""
    from types import SimpleNamespace

    from schemas.metrics import QueueReport

    manager = HealthManager.__new__(HealthManager)
    manager.queues = {}

    async def report(instance: str, at: float) -> None:
        msg = SimpleNamespace(data=encode(QueueReport("trainer", instance, "train", at)))
        await manager.on_queues(cast(Msg, msg))

    for i in range(50):
        await report(f"trainer-{i}", 1000.0 + 60 * i)  # one instance after another
    await report("trainer-49b", 1000.0 + 60 * 49 + 1)
    assert set(manager.queues) == {"trainer.trainer-49", "trainer.trainer-49b"}


@pytest.mark.timeout(90)
async def test_a_role_whose_event_loop_hangs_exits_75_by_itself(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """Where no health manager can kill it (a container, another host), a role whose event
    loop has not run for ``--loop-stall-s`` exits 75 for its supervisor to restart it."""
    marker = tmp_path / "hung"
    log = tmp_path / "envs.log"
    args = ("--hang-after-s", "2", "--hang-marker", str(marker), "--loop-stall-s", "3")
    proc = procs.add(start_service("envs", fresh_server.url, log, *args))
    await eventually(marker.exists, timeout=60, what="the env worker freezing")
    t_frozen = time.monotonic()
    assert await asyncio.to_thread(proc.wait, 30) == 75
    assert time.monotonic() - t_frozen < 15
    assert "event loop stalled" in log.read_text(errors="replace")
