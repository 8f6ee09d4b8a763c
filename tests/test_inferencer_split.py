"""The inferencer splits a compatible group where its cost table says smaller forwards are
faster: every request is still answered exactly once, with the results of the unsplit batch
(up to float rounding, in process), and a real inferencer reading its table from a file groups
no further than the table allows."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.codec import decode
from bus.inference import PolicyClient
from bus.publish import publish
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.infer import ACT_REPLY_DECODER, ActReply, ActRequest
from schemas.model import HeadConfig, OptimizerConfig
from schemas.train import OpenSlot
from services.inferencer.batching import BatchRunner, Work
from services.inferencer.policies import ServedPolicy
from tests.helpers import eventually, uid
from tests.test_inferencer import (
    DISCRETE,
    FLOW,
    OFT,
    TOKEN_BUDGET,
    commit_policy,
    gauges_of,
    in_process,
    launch,
    make_obs,
    wait_serving,
)
from vla.backbone import Backbone
from vla.costmodel import CostTable
from vla.slot import TenantSlot

#: A table whose forwards get dearer past 2 samples: groups of at most 2 observations.
KNEE_AT_2 = CostTable("tiny", "cpu", "float32", 1, 36, ((1, 5.0), (2, 6.0), (3, 60.0)))


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    torch.set_num_threads(1)
    return Backbone.load("tiny")


def served(tenant: str, head: HeadConfig, hidden: int, seed: int) -> ServedPolicy:
    slot = TenantSlot(f"{tenant}/job", head, OptimizerConfig(), hidden, seed=seed)
    spec = OpenSlot(tenant, "job", head, OptimizerConfig(), seed, 10, token_budget=TOKEN_BUDGET)
    return ServedPolicy(tenant, "job", 1, slot, spec)


def test_a_split_batch_answers_every_request_with_the_unsplit_results(
    backbone: Backbone,
) -> None:
    policies = [
        served("a", OFT, backbone.hidden_size, 1),
        served("b", DISCRETE, backbone.hidden_size, 2),
        served("c", FLOW, backbone.hidden_size, 3),
    ]
    batch = []
    for i in range(9):
        policy = policies[i % 3]
        obs = [make_obs(policy.head, 100 + 10 * i + j) for j in range(1 + i % 2)]
        # Deterministic or seeded: each request's actions depend only on its inputs.
        seed = 50 + i if i % 3 == 2 else -1
        request = ActRequest(
            policy.tenant, "job", f"r{i}", "_INBOX.x", obs, deterministic=seed < 0, seed=seed
        )
        batch.append(Work(request, policy))

    whole, whole_stats = BatchRunner(backbone).run(batch)
    split, split_stats = BatchRunner(backbone, KNEE_AT_2).run(batch)

    assert whole_stats.forwards == 1 and whole_stats.observations == 13
    assert split_stats.observations == 13
    # Nine requests of 1-2 observations in groups of at most 2 observations.
    assert split_stats.forwards >= 7
    assert len(split) == len(whole) == len(batch)
    for i, (s, w) in enumerate(zip(split, whole, strict=True)):
        assert s.error is None and w.error is None, (i, s.error, w.error)
        assert w.group_size == 9
        assert 1 <= s.group_size <= 2
        for name in ("actions_B_C_A", "log_prob_B", "value_B"):
            a, b = getattr(s, name), getattr(w, name)
            if b is None:
                assert a is None
            else:
                # Each sample's forward is its own, but a CPU's matmul kernels may block a
                # larger batch differently (AVX-512 does), so only up to float rounding.
                np.testing.assert_allclose(
                    a, b, rtol=1e-5, atol=1e-6, err_msg=f"request {i} {name}"
                )


async def test_an_inferencer_with_a_cost_table_file_answers_each_request_once_in_groups_it_allows(
    nats_server: EmbeddedServer, nc: NATS, js: JetStreamContext, backbone: Backbone, tmp_path: Path
) -> None:
    table = tmp_path / "costs.json"
    KNEE_AT_2.save(table)
    replica = launch(
        nats_server.url, tmp_path / "inf.log", "--max-wait-ms", "200", "--cost-table", str(table)
    )
    try:
        await wait_serving(js, replica)
        a, b = uid("split-a"), uid("split-b")
        slots = {
            a: await commit_policy(js, a, "job", OFT, backbone.hidden_size, seed=4),
            b: await commit_policy(js, b, "job", FLOW, backbone.hidden_size, seed=5),
        }
        heads = {a: OFT, b: FLOW}
        # Load both policies first, so the burst below meets in one batch of 8 observations.
        async with await PolicyClient.create(nc, "tiny", js) as client:
            for tenant in (a, b):
                await client.act(tenant, "job", [make_obs(heads[tenant], 1)])
        inbox = nc.new_inbox()
        replies: dict[str, list[ActReply]] = {}
        got_all = asyncio.Event()
        sent: dict[str, tuple[str, list]] = {}

        async def on_reply(msg: Msg) -> None:
            reply = decode(ACT_REPLY_DECODER, msg.data)
            replies.setdefault(reply.request_id, []).append(reply)
            if len(replies) == len(sent):
                got_all.set()

        sub = await nc.subscribe(f"{inbox}.>", cb=on_reply)
        for i in range(8):
            tenant = (a, b)[i % 2]
            rid = f"{uid('req')}-{i}"
            obs = [make_obs(heads[tenant], 300 + i)]
            sent[rid] = (tenant, obs)
        await asyncio.gather(
            *(
                publish(
                    js,
                    subjects.infer("tiny", tenant),
                    ActRequest(tenant, "job", rid, f"{inbox}.{rid}", obs, deterministic=True),
                    message_id=rid,
                )
                for rid, (tenant, obs) in sent.items()
            )
        )
        await asyncio.wait_for(got_all.wait(), 30)

        async def served_all() -> bool:
            gauges = await gauges_of(js, replica)
            return gauges is not None and gauges["requests_served"] >= len(sent) + 2

        assert await eventually(served_all, timeout=20, what="every request counted as served")
        await nc.flush()  # replies published before the count are here by now
        await sub.unsubscribe()
        gauges = await gauges_of(js, replica)
        # The two warm-up requests and each of the burst's once.
        assert gauges is not None and gauges["requests_served"] == len(sent) + 2
        assert sorted(replies) == sorted(sent)
        for rid, (tenant, obs) in sent.items():
            assert len(replies[rid]) == 1, f"{rid} answered {len(replies[rid])} times"
            reply = replies[rid][0]
            assert reply.error == "" and reply.actions is not None
            # Without the table these 8 would share one forward (B = 16, T = 200 ms).
            assert reply.group_size <= 2, "no forward past the table's knee"
            np.testing.assert_allclose(
                reply.actions.to_numpy(),
                in_process(backbone, slots[tenant], obs),
                rtol=1e-5,
                atol=1e-5,
            )
        assert gauges["forwards"] >= 2 + len(sent) / 2
    finally:
        replica.proc.terminate()
        try:
            replica.proc.wait(30)
        except subprocess.TimeoutExpired:
            replica.proc.kill()
            replica.proc.wait()


def test_a_bad_feature_record_from_the_backbone_role_is_not_blamed_on_the_request(
    backbone: Backbone,
) -> None:
    """Only normalising a request's observations says the request is bad (refused, never
    retried); a feature record the backbone role got wrong was also reported as the tenant's
    "bad observation" and refused for good, since it is a ValueError too."""
    from bus.errors import PoisonError
    from bus.fate import retry_decision
    from schemas.tensor import Tensor
    from vla.feature import ModelInputs
    from vla.wire import FeatureRecordError

    class BrokenBackboneRole:
        def encode(self, inputs: ModelInputs) -> Any:
            raise FeatureRecordError("prefix: 3 values are NaN or infinite")

    policy = served("a", OFT, backbone.hidden_size, 1)
    good = make_obs(OFT, 1)
    rgba = Tensor.from_numpy(np.zeros((64, 64, 4), np.uint8))
    bad = type(good)([rgba], good.instruction, good.proprio)
    batch = [
        Work(ActRequest("a", "job", f"r{i}", "_INBOX.x", [obs], deterministic=True), policy)
        for i, obs in enumerate([good, bad])
    ]
    outcomes, _ = BatchRunner(backbone, None, BrokenBackboneRole()).run(batch)
    backbone_error, request_error = (o.error for o in outcomes)
    assert isinstance(backbone_error, FeatureRecordError)
    assert retry_decision(backbone_error, 1)[0], "the service's fault: retried"
    assert isinstance(request_error, PoisonError)
    assert str(request_error).startswith("bad observation for a/job v1:")
