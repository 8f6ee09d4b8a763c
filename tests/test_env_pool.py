"""The env worker's pool of simulator sessions: reused across tasks of one kind, and bounded.
Found by an audit: every (env, image size, episode limit, env kwargs) a tenant chose was a
kind kept for good, so a few short jobs with different episode limits filled the worker's
memory (256 Reach2D sessions of 512 px: about 1.1 GiB per kind)."""

from __future__ import annotations

import pytest

import services.envs.pool as pool_module
from services.envs.adapters import EnvAdapter, make_adapter
from services.envs.pool import AdapterPool
from services.envs.sims import REACH2D_ID


@pytest.fixture
def closed(monkeypatch: pytest.MonkeyPatch) -> list[EnvAdapter]:
    """Real Reach2D adapters, each recorded when it is closed."""
    record: list[EnvAdapter] = []

    def recording_make_adapter(env_id: str, **kwargs: object) -> EnvAdapter:
        adapter = make_adapter(env_id, **kwargs)  # type: ignore[arg-type]
        close = adapter.close

        def recorded_close() -> None:
            record.append(adapter)
            close()

        adapter.close = recorded_close  # type: ignore[method-assign]
        return adapter

    monkeypatch.setattr(pool_module, "make_adapter", recording_make_adapter)
    return record


def idle(pool: AdapterPool) -> dict[int, int]:
    """Idle sessions by episode limit (the kind these tests vary)."""
    return {int(kind[2]): len(free) for kind, free in pool.idle.items()}  # type: ignore[call-overload]


async def test_sessions_are_reused_by_kind_and_idle_ones_bounded_least_recently_used_first(
    closed: list[EnvAdapter],
) -> None:
    pool = AdapterPool(max_idle=3)
    async with pool.sessions(REACH2D_ID, 16, 5, 2) as first:
        assert len(first) == 2 and idle(pool) == {5: 0}
    async with pool.sessions(REACH2D_ID, 16, 5, 2) as again:
        assert set(map(id, again)) == set(map(id, first))  # the same sessions, none built
    assert pool.built[REACH2D_ID] == 2 and closed == []
    async with pool.sessions(REACH2D_ID, 16, 6, 2) as other:
        pass
    # 4 idle past the bound of 3: the least recently used kind (limit 5) gives one up.
    assert idle(pool) == {5: 1, 6: 2} and pool.evicted == 1
    assert len(closed) == 1 and closed[0] in first
    async with pool.sessions(REACH2D_ID, 16, 5, 1):
        pass  # limit 5 is now the most recently used kind
    async with pool.sessions(REACH2D_ID, 16, 7, 2):
        pass
    assert idle(pool) == {5: 1, 7: 2}  # limit 6's went first
    assert set(map(id, closed)) >= set(map(id, other)) and pool.evicted == 3
    gauges = pool.gauges()
    assert gauges["sessions_idle"] == 3 and gauges["sessions_evicted"] == 3


async def test_a_task_larger_than_the_bound_runs_and_keeps_only_the_bound(
    closed: list[EnvAdapter],
) -> None:
    pool = AdapterPool(max_idle=2)
    async with pool.sessions(REACH2D_ID, 16, 5, 4, {"success_radius": 0.2}) as sessions:
        assert len(sessions) == 4
    assert sum(idle(pool).values()) == 2 and len(closed) == 2
    assert (await pool.prewarm(REACH2D_ID, 16, 9, 5)) == (2, 2)  # at most the bound
    assert sum(idle(pool).values()) == 2 and len(closed) == 4
    none = AdapterPool(max_idle=0)
    async with none.sessions(REACH2D_ID, 16, 5, 1):
        pass
    assert none.idle == {} and len(closed) == 5
    with pytest.raises(ValueError, match="max_idle must be >= 0"):
        AdapterPool(max_idle=-1)


async def test_a_prewarm_whose_kind_is_trimmed_while_it_builds_loses_no_session(
    closed: list[EnvAdapter],
) -> None:
    """Another task's trim can drop the kind a prewarm is filling while it waits for a build:
    the sessions it builds after that still go into the pool (none held by nobody)."""
    pool = AdapterPool(max_idle=2)
    builds = 0

    async def other_task_meanwhile() -> None:
        nonlocal builds
        builds += 1
        if builds == 2:  # the prewarm's second build: another kind comes and goes
            pool.on_build = None
            async with pool.sessions(REACH2D_ID, 16, 5, 2):
                pass

    pool.on_build = other_task_meanwhile
    idle_now, built = await pool.prewarm(REACH2D_ID, 16, 9, 2)
    # Its first session was trimmed away with its kind (the other kind's two were newer),
    # so it built three; then the other kind's two went.
    every = pool.built[REACH2D_ID]
    assert every == 5 and built == 3
    assert idle(pool) == {9: 2} and idle_now == 2
    assert len(closed) == 3  # each session built is idle or closed, none held by nobody
