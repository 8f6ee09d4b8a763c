"""The discrete-event model (bench/simulate.py): exact on cases small enough to work out by
hand, and consistent on the paper's mix. Its validation against a measured run is
tests/test_demo.py."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from bench.servicemodel import Costs, Simulation, TenantLoad, Topology
from bench.simulate import CostsFile, DemoCosts, compare, main

COSTS = Costs(
    sft_step_s=0.01,
    sft_per_sample_s=0.001,
    sft_round_overhead_s=0.005,
    rl_update_s=0.02,
    rl_per_sample_s=0.002,
    commit_s=0.1,
    act_batch_s=0.004,
    act_per_sample_s=0.001,
    env_step_s=0.002,
    reset_s=0.003,
    env_step_overhead_s=0.0007,
    hop_s=0.0005,
    job_start_s=0.05,
    job_end_s=0.01,
)


def test_one_sft_tenant_takes_its_steps_back_to_back_then_commits() -> None:
    tenant = TenantLoad("a", "sft", iterations=25, batch_size=8, checkpoint_every=10)
    run = Simulation(COSTS, Topology(), [tenant]).run()
    busy = 0.01 + 0.001 * 8
    assert run.makespan_s == pytest.approx(0.05 + 25 * (busy + 0.005) + 0.1 + 0.01)
    assert run.completion_s == {"a": pytest.approx(run.makespan_s)}
    assert run.services["train"].busy_s == pytest.approx(25 * busy)
    assert run.services["infer"].busy_s == 0.0 and run.services["env"].busy_s == 0.0


def test_one_rl_step_follows_the_path_of_a_real_iteration() -> None:
    """Task out, reset, act request (waits the batch timer, one forward), env step,
    rollout in, update, commit, end."""
    tenant = TenantLoad(
        "r", "rl", iterations=1, episodes_per_iteration=1, parallel_envs=1, episode_steps=1
    )
    topo = Topology(max_batch=4, max_wait_s=0.003)
    run = Simulation(COSTS, topo, [tenant]).run()
    act = 0.004 + 0.001 * 1
    expected = (
        0.05  # job start
        + 0.0005  # the task to a worker
        + 0.003  # reset
        + 0.0007  # observation to a message
        + 0.0005  # the request to INFER
        + 0.003  # a lone request waits T
        + act
        + 0.0005  # the answer back
        + 0.002  # the env step
        + 0.0005  # the rollout to TRAIN
        + 0.02
        + 0.002  # the update over one sample
        + 0.1
        + 0.0005  # commit, then the version's event
        + 0.01  # job end
    )
    assert run.makespan_s == pytest.approx(expected)
    assert run.services["env"].busy_s == pytest.approx(0.003 + 0.002)
    assert run.services["infer"].busy_s == pytest.approx(act)
    assert run.services["train"].busy_s == pytest.approx(0.022)


def test_act_requests_of_several_tenants_share_a_forward() -> None:
    tenants = [
        TenantLoad(
            f"r{i}", "rl", iterations=1, episodes_per_iteration=1, parallel_envs=1, episode_steps=5
        )
        for i in range(4)
    ]
    run = Simulation(COSTS, Topology(env=4, max_batch=4), tenants).run()
    # 4 tenants x 5 steps = 20 requests; with batching, far fewer forwards
    assert run.services["infer"].ops < 20


def test_an_env_workers_overlapping_simulator_calls_count_once() -> None:
    """Two tenants' tasks on one worker run at the same time (its threads): the worker is
    busy for the union of their calls, not their sum."""
    tenants = [
        TenantLoad(
            f"r{i}",
            "rl",
            iterations=1,
            episodes_per_iteration=2,
            parallel_envs=2,
            episode_steps=3,
            reset_s=0.05,
        )
        for i in range(2)
    ]
    run = Simulation(COSTS, Topology(env=1), tenants).run()
    calls = 2 * (2 * 0.05 + 3 * 2 * 0.002)
    assert run.services["env"].busy_s < calls
    # both resets start together: at least one of them, and each call once, is busy time
    assert run.services["env"].busy_s >= 2 * 0.05


def test_sharing_cuts_aggregate_time_and_raises_utilisation_on_the_paper_mix() -> None:
    tenants = [
        TenantLoad("rl-a", "rl", 3),
        TenantLoad("rl-b", "rl", 3, episodes_per_iteration=6, env_step_s=0.004),
        TenantLoad("rl-c", "rl", 2, episode_steps=30),
        TenantLoad("sft", "sft", 40, batch_size=8),
    ]
    cmp = compare(COSTS, Topology(train=1, infer=1, env=3), tenants)
    assert 0.0 < cmp.aggregate_time_reduction < 1.0
    for service in ("train", "infer", "env"):
        iso, multi = cmp.utilisation("isolated", service), cmp.utilisation("shared", service)
        assert 0.0 <= iso <= 1.0 and 0.0 <= multi <= 1.0
        assert multi > iso, service
    # isolated completion accumulates the waits of tenants before it
    values = list(cmp.isolated_completion_s.values())
    assert values == sorted(values)
    again = compare(COSTS, Topology(train=1, infer=1, env=3), tenants)
    assert again.shared.makespan_s == cmp.shared.makespan_s  # deterministic


def test_the_command_reads_a_costs_file_and_writes_projections(tmp_path: Path) -> None:
    tenants = [TenantLoad("push", "rl", 2, env_step_s=0.01), TenantLoad("sft", "sft", 20)]
    costs = tmp_path / "costs.json"
    costs.write_bytes(msgspec.json.encode(CostsFile(COSTS, Topology(max_batch=8), tenants)))
    out = tmp_path / "proj.json"
    assert main(["--costs", str(costs), "--tenants", "4,8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tenants"] for r in rows] == [4, 8]
    assert all(r["bottleneck"] in ("train", "infer", "env") for r in rows)
    # the demo's file: its isolated phase's costs are projected
    demo = tmp_path / "demo.json"
    file = CostsFile(COSTS, Topology(), tenants)
    demo.write_bytes(msgspec.json.encode(DemoCosts(file, file)))
    assert main(["--costs", str(demo), "--tenants", "2"]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"costs": {"train_round": 1}}')
    with pytest.raises(SystemExit, match="train_round"):
        main(["--costs", str(bad)])


def test_joynexus_simulate_passes_its_options_through(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cli import main as joynexus

    assert joynexus(["simulate", "--tenants", "4", "--train", "1", "--env", "2"]) == 0
    assert "bottleneck" in capsys.readouterr().out
