"""The discrete-event model (bench/simulate.py): exact on cases small enough to work out by
hand, and consistent on the paper's mix."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from bench.simulate import Costs, CostsFile, Simulation, TenantLoad, Topology, compare, main

COSTS = Costs(
    train_round_s=0.01,
    train_per_sample_s=0.001,
    train_per_tenant_s=0.005,
    commit_s=0.1,
    act_batch_s=0.004,
    act_per_sample_s=0.001,
    env_step_s=0.002,
    hop_s=0.0005,
)


def test_one_sft_tenant_takes_its_steps_and_commits_back_to_back() -> None:
    tenant = TenantLoad("a", "sft", iterations=25, batch_size=8, checkpoint_every=10)
    run = Simulation(COSTS, Topology(), [tenant]).run()
    per_step = 0.01 + 0.001 * 8 + 0.005
    commits = 3  # steps 10, 20 and the last
    assert run.makespan_s == pytest.approx(25 * per_step + commits * 0.1)
    assert run.completion_s == {"a": pytest.approx(run.makespan_s)}
    assert run.services["train"].utilisation == pytest.approx(1.0)
    assert run.services["infer"].busy_s == 0.0


def test_one_rl_step_waits_for_the_batch_timer_then_trains() -> None:
    tenant = TenantLoad("r", "rl", iterations=1, episodes_per_iteration=1, episode_steps=1)
    topo = Topology(max_batch=4, max_wait_s=0.003)
    run = Simulation(COSTS, topo, [tenant]).run()
    act = 0.003 + 0.004 + 0.001  # a lone request waits max_wait, then a forward of one
    env = 0.002
    train = 0.01 + 0.001 * 1 + 0.005 + 0.1
    hops = 0.0005 * 4  # env → infer, infer → env, episode → TRAIN, start of the iteration
    assert run.makespan_s == pytest.approx(hops + act + env + train)
    assert run.services["env"].busy_s == pytest.approx(env)
    assert run.services["infer"].busy_s == pytest.approx(0.005)


def test_act_requests_of_several_tenants_share_a_forward() -> None:
    tenants = [
        TenantLoad(f"r{i}", "rl", iterations=1, episodes_per_iteration=1, episode_steps=5)
        for i in range(4)
    ]
    run = Simulation(COSTS, Topology(env=1, env_sessions=4, max_batch=4), tenants).run()
    # 4 tenants x 5 steps = 20 requests; with batching, far fewer forwards
    assert run.services["infer"].ops < 20
    assert run.services["env"].ops == 20


def test_sharing_cuts_aggregate_time_and_raises_utilisation_on_the_paper_mix() -> None:
    tenants = [
        TenantLoad("rl-a", "rl", 3),
        TenantLoad("rl-b", "rl", 3, episodes_per_iteration=6),
        TenantLoad("rl-c", "rl", 2, episode_steps=30),
        TenantLoad("sft", "sft", 40, batch_size=8),
    ]
    cmp = compare(COSTS, Topology(train=1, infer=1, env=2), tenants)
    assert 0.0 < cmp.aggregate_time_reduction < 1.0
    for service in ("train", "infer", "env"):
        iso, multi = cmp.utilisation("isolated", service), cmp.utilisation("shared", service)
        assert 0.0 <= iso <= 1.0 and 0.0 <= multi <= 1.0
        assert multi > iso, service
    # isolated completion accumulates the waits of tenants before it
    values = list(cmp.isolated_completion_s.values())
    assert values == sorted(values)
    again = compare(COSTS, Topology(train=1, infer=1, env=2), tenants)
    assert again.shared.makespan_s == cmp.shared.makespan_s  # deterministic


def test_the_command_reads_a_costs_file_and_writes_projections(tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    costs.write_bytes(msgspec.json.encode(CostsFile(COSTS, Topology(max_batch=8))))
    out = tmp_path / "proj.json"
    assert main(["--costs", str(costs), "--tenants", "4,8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tenants"] for r in rows] == [4, 8]
    assert all(r["bottleneck"] in ("train", "infer", "env") for r in rows)
    bad = tmp_path / "bad.json"
    bad.write_text('{"costs": {"train_round": 1}}')
    with pytest.raises(SystemExit, match="train_round"):
        main(["--costs", str(bad)])


def test_joynexus_simulate_passes_its_options_through(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cli import main as joynexus

    assert joynexus(["simulate", "--tenants", "4", "--train", "1", "--env", "2"]) == 0
    assert "bottleneck" in capsys.readouterr().out
