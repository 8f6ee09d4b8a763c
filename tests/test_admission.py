"""Admission and scheduling policy per tenant: a tenant at its limits waits (queued, with
the reason) while others go on; batches are shared by weight; the operator's limits shape
what a job is served."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from bus.codec import decode, encode
from bus.connect import connect
from bus.declare import declare
from bus.server import EmbeddedServer
from clients.sdk import Client
from schemas import subjects
from schemas.events import StateChanged
from schemas.metrics import QUEUE_REPORT_DECODER, QueueReport
from schemas.specs import parse_job_spec
from schemas.tenants import TenantLimits, TenantRecord
from services.inferencer.fairness import Waiting, fair_take
from services.master.limits import Holding, apply_limits, check_fits, holding
from services.master.plans import Plan
from tests.conftest import Procs
from tests.helpers import uid
from tests.sft_helpers import OFT_2D, record_datasets, registered, sft_spec, start_stack


# -- sharing a batch ----------------------------------------------------------------------------
def test_waiting_requests_that_fit_one_batch_all_go_in_arrival_order() -> None:
    waiting = [Waiting("a/1", 4, 1), Waiting("b/1", 4, 4), Waiting("a/1", 4, 1)]
    credit = {"stale/1": 3.0}
    assert fair_take(waiting, 16, credit) == [0, 1, 2]
    assert credit == {}


def test_a_flooding_job_gets_its_weights_share_of_the_batches_not_all_of_them() -> None:
    """Over many batches of 16 observations, jobs of weight 1, 2 and 4 that always have
    requests waiting get observations in proportion 1 : 2 : 4, whoever sent first."""
    weights = {"flood/1": 1, "mid/1": 2, "vip/1": 4}
    queue = [Waiting("flood/1", 1, 1) for _ in range(200)]  # the flood arrived first
    queue += [Waiting(j, 1, w) for j, w in weights.items() if j != "flood/1" for _ in range(200)]
    credit: dict[str, float] = {}
    served: Counter[str] = Counter()
    for _ in range(40):
        chosen = fair_take(queue, 16, credit)
        assert sum(queue[i].observations for i in chosen) <= 16
        served.update(queue[i].job for i in chosen)
        queue = [w for i, w in enumerate(queue) if i not in set(chosen)]
        # everyone keeps sending: each job has 50 requests waiting again
        for job, weight in weights.items():
            queue += [Waiting(job, 1, weight)] * (50 - sum(w.job == job for w in queue))
    total = sum(served.values())
    for job, weight in weights.items():
        assert served[job] / total == pytest.approx(weight / 7, abs=0.03), served


def test_a_request_larger_than_the_batch_still_goes_alone() -> None:
    waiting = [Waiting("big/1", 40, 1), Waiting("small/1", 1, 1)]
    assert fair_take(waiting, 16, {}) in ([0], [1])
    assert fair_take([Waiting("big/1", 40, 1)], 16, {}) == [0]


def test_a_request_larger_than_the_batch_goes_alone_once_its_job_is_owed_it() -> None:
    """Other jobs keep the queue busy with requests that fit: the large one still goes, after
    its job has earned its observations (before, it waited as long as they kept sending)."""
    small = [f"small-{i}/1" for i in range(6)]
    queue = [Waiting("big/1", 32, 1)] + [Waiting(j, 8, 1) for j in small for _ in range(3)]
    credit: dict[str, float] = {}
    batches = 0
    while batches < 200:
        batches += 1
        chosen = fair_take(queue, 16, credit)
        if [queue[i].job for i in chosen] == ["big/1"]:
            break
        assert "big/1" not in {queue[i].job for i in chosen}
        queue = [w for i, w in enumerate(queue) if i not in set(chosen)]
        for job in small:  # everyone else keeps three requests waiting
            queue += [Waiting(job, 8, 1)] * (3 - sum(w.job == job for w in queue))
    else:
        raise AssertionError("the large request never went")
    # Its job's credit paid for it: about 32 rounds of weight 1, spread over the batches.
    assert 2 <= batches <= 60, batches
    assert credit["big/1"] < 1


def test_requests_all_larger_than_a_batch_are_shared_by_weight_not_arrival() -> None:
    """Found by an audit: when every job's next request was larger than a batch, the oldest
    went, whatever the weights: a flood of 256-observation requests kept a weight-8 job's
    17-observation one waiting 16 forwards. Now each goes alone when its job's credit,
    earned at its weight, covers it: in observations, shares follow the weights."""
    queue = [Waiting("flood/1", 256, 1) for _ in range(16)] + [Waiting("vip/1", 17, 8)]
    credit: dict[str, float] = {}
    first = fair_take(queue, 16, credit)
    assert [queue[i].job for i in first] == ["vip/1"]  # 3 rounds of 8 cover it; 256 need 256
    served: Counter[str] = Counter()
    for _ in range(3000):
        chosen = fair_take(queue, 16, credit)
        assert len(chosen) == 1
        served[queue[chosen[0]].job] += queue[chosen[0]].observations
        # both keep sending: the flood keeps 16 requests waiting, the vip 1
        queue = [w for i, w in enumerate(queue) if i != chosen[0]]
        queue += [Waiting("flood/1", 256, 1)] * (16 - sum(w.job == "flood/1" for w in queue))
        queue += [Waiting("vip/1", 17, 8)] * (1 - sum(w.job == "vip/1" for w in queue))
    assert served["vip/1"] / served["flood/1"] == pytest.approx(8, rel=0.1), served


# -- what a job holds and is served -------------------------------------------------------------
def _rl(**kw: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "kind": "rl",
        "tenant": "acme",
        "env": "JoyNexus/Reach2D-v0",
        "head": {"kind": "oft", "value_head": True},
        "iterations": 2,
        "episodes_per_iteration": 6,
    }
    spec.update(kw)
    return spec


def test_holdings_and_what_could_never_fit() -> None:
    assert holding(parse_job_spec(_rl())) == Holding(1, 1, 6)
    lagged = parse_job_spec(_rl(rl={"max_policy_lag": 1}))
    assert holding(lagged) == Holding(1, 1, 12)  # two iterations may run at once
    sft = parse_job_spec(sft_spec("acme", "demos", OFT_2D, 10))
    assert holding(sft) == Holding(1, 1, 0)
    pipe = parse_job_spec(
        {"kind": "pipeline", "tenant": "acme", "stages": [sft.model_dump(), _rl()]}
    )
    assert holding(pipe) == Holding(1, 1, 6)  # what its largest stage holds, once
    limits = TenantLimits(max_env_sessions=8, max_inflight_samples=40)
    check_fits(parse_job_spec(_rl()), limits)
    with pytest.raises(Exception, match="12 simulator sessions at once exceeds max_env_sessions 8"):
        check_fits(lagged, limits)
    with pytest.raises(Exception, match=r"stages.0.checkpoint_every x batch_size: 48"):
        check_fits(pipe, limits)  # 6 x 8 samples of a commit interval in flight


def test_the_plan_is_served_with_the_tenants_weight_and_in_flight_samples() -> None:
    from schemas.env import StreamDataset
    from schemas.model import HeadConfig, OptimizerConfig
    from schemas.train import OpenSlot

    slot = OpenSlot("acme", "j", HeadConfig(kind="oft", action_dim=2), OptimizerConfig(), 0, 9)
    stream = StreamDataset("acme", "j", "tiny", "demos", 8, 100, 1, 1, 0, max_in_flight=24)
    plan = Plan("tiny", slot, [stream])
    served = apply_limits(plan, TenantLimits(priority="high", max_inflight_samples=96))
    assert served.open_slot is not None and served.open_slot.priority == 4
    assert isinstance(served.env_tasks[0], StreamDataset)
    assert served.env_tasks[0].max_in_flight == 12  # 96 samples / batches of 8
    assert apply_limits(plan, None) is plan  # open mode: no limits


# -- a tenant at its limit waits; the others do not ---------------------------------------------
@pytest.mark.timeout(240)
async def test_a_tenant_at_its_job_limit_waits_queued_while_another_tenant_runs(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    data = record_datasets(tmp_path / "data")
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    alice, bob = uid("alice"), uid("bob")
    tenants = await js.key_value(subjects.KV_TENANTS)
    now = time.time()
    await tenants.put(alice, encode(TenantRecord(alice, "U" + "A" * 55, now, TenantLimits(1))))
    await tenants.put(bob, encode(TenantRecord(bob, "U" + "B" * 55, now)))
    reports: list[QueueReport] = []

    async def collect(msg: Msg) -> None:
        reports.append(decode(QUEUE_REPORT_DECODER, msg.data))

    await nc.subscribe(f"{subjects.QUEUE_METRICS}.>", cb=collect)
    start_stack(fresh_server.url, tmp_path / "logs", procs)
    async with await Client.connect(fresh_server.url) as client:
        a_data = await registered(js, alice, data["reach"])
        b_data = await registered(js, bob, data["reach"])
        first = await client.train_sft(sft_spec(alice, a_data, OFT_2D, 60), job_id="a1")
        second = await client.train_sft(sft_spec(alice, a_data, OFT_2D, 6), job_id="a2")
        other = await client.train_sft(sft_spec(bob, b_data, OFT_2D, 6), job_id="b1")
        results = [await j.wait(180) for j in (first, second, other)]
        assert [r.status for r in results] == ["succeeded"] * 3
        states = {j.job_id: [e async for e in j.events()] for j in (first, second, other)}
    await nc.close()

    def at(job: str, status: str) -> float:
        found = [e for e in states[job] if isinstance(e, StateChanged) and e.status == status]
        assert found, f"{job} never {status}: {states[job]}"
        return found[0].at

    queued = [e for e in states["a2"] if isinstance(e, StateChanged) and e.status == "queued"]
    assert queued and "max_concurrent_jobs is 1" in queued[0].reason and "a1" in queued[0].reason
    assert at("a2", "running") >= at("a1", "succeeded")  # it started once a1 left room
    assert at("b1", "running") < at("a1", "succeeded")  # bob never waited behind alice
    assert not [e for e in states["b1"] if isinstance(e, StateChanged) and e.status == "queued"]
    # The master published alice's waiting job as her jobs queue; the trainer its own.
    waits = [t for r in reports if r.queue == "jobs" for t in r.tenants if t.tenant == alice]
    assert waits and all(t.depth == 1 for t in waits), waits
    assert {r.service for r in reports} >= {"master", "trainer"}
