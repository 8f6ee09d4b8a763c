"""The backbone served apart from the heads (``services.backbone``, ``--backbone-service``).

Shown: features over the bus are bit for bit the resident backbone's, inline and by reference
(a request and its answer over the server's max payload travel through the feature bucket,
which keeps nothing afterwards); a request for another layer, a malformed one and a missing
input are refused naming the field; no backbone gives a retryable error at once; a session on
a head-only trainer reaches the in-process losses and parameters, across a SIGKILL of the
backbone role and its restart; a head-only inferencer samples from it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from nats.js.errors import NotFoundError

from bus.codec import decode
from bus.connect import connect
from bus.declare import declare
from bus.encoding import BackboneUnavailable, EncodeRefused, FeatureClient
from bus.inference import observation
from bus.server import EmbeddedServer
from clients.lowlevel import AdamParams, CallOutput, ServiceClient, VLABatch
from schemas import subjects
from schemas.feature import ENCODE_REPLY_DECODER, EncodeError, FeatureRecord
from schemas.tensor import Tensor
from tests.conftest import Procs
from tests.helpers import eventually, start_service, uid
from tests.test_lowlevel import HEAD, TOKEN_BUDGET, Plan, assert_same_slot, reference, saved_slot
from vla.backbone import Backbone
from vla.feature import PIXELS_U8, ModelInputs
from vla.normalize import Normaliser
from vla.wire import FeatureRecordError, WireEncoder, to_encode_request


def inputs_of(
    backbone: Backbone, batch: int, seed: int = 0, *, uint8_pixels: bool = False
) -> ModelInputs:
    rng = np.random.default_rng(seed)
    size = backbone.image_size
    normaliser = Normaliser(backbone, 1, TOKEN_BUDGET, uint8_pixels=uint8_pixels)
    return normaliser.normalise_arrays(
        rng.integers(0, 255, (batch, 1, size, size, 3), dtype=np.uint8),
        [f"push the block {i}" for i in range(batch)],
        rng.standard_normal((batch, 4)).astype(np.float32),
    )


def _without(tensors: dict[str, Tensor], name: str) -> dict[str, Tensor]:
    return {n: t for n, t in tensors.items() if n != name}


async def until_answering(client: FeatureClient, backbone: Backbone) -> None:
    """Wait (60 s at most) for a backbone role started just now to answer ``client``."""

    async def answered() -> bool:
        client._unavailable_until = 0.0  # (after a miss the client waits before asking again)
        inputs = inputs_of(backbone, 1)
        request = to_encode_request(inputs, backbone.feature_layer, ["0"])
        try:
            await client.request(request)
        except BackboneUnavailable:
            return False
        return True

    await eventually(answered, timeout=60, what="the backbone role answering")


@pytest.mark.timeout(120)
async def test_features_over_the_bus_are_the_resident_ones_inline_and_by_reference(
    tmp_path: Path, procs: Procs
) -> None:
    server = EmbeddedServer(tmp_path / "nats", max_payload=128 * 1024).start()
    nc = await connect(server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        backbone = Backbone.load("tiny")
        client = FeatureClient(nc, js, asyncio.get_running_loop(), "tiny", timeout_s=5)
        layer = backbone.feature_layer
        # The sync path a trainer's worker thread takes.
        remote = WireEncoder(client.request_sync, layer)

        def ask(inputs: ModelInputs, feature_layer: int = layer) -> Awaitable[FeatureRecord]:
            ids = [str(i) for i in range(inputs.batch_size)]
            return client.request(to_encode_request(inputs, feature_layer, ids))

        with pytest.raises(BackboneUnavailable, match="no backbone instance serves 'tiny'"):
            await asyncio.to_thread(remote.encode, inputs_of(backbone, 1))
        proc = procs.add(start_service("backbone", server.url, tmp_path / "backbone.log"))

        await until_answering(client, backbone)
        # 40 samples: request and answer both over 128 KiB. Views sent as uint8 (what
        # head-only roles send) come back as the features of the values normalised here.
        for batch, uint8_pixels in ((3, False), (40, False), (3, True), (40, True)):
            inputs = inputs_of(backbone, batch, seed=batch, uint8_pixels=uint8_pixels)
            there = await asyncio.to_thread(remote.encode, inputs)
            here = backbone.encode(inputs_of(backbone, batch, seed=batch))
            assert torch.equal(there.prefix_B_T_D, here.prefix_B_T_D)
            assert torch.equal(there.mask_B_T, here.mask_B_T)
            assert torch.equal(there.proprio_B_P, inputs.proprio_B_P)
        with pytest.raises(RuntimeError, match="from a worker thread"):
            remote.encode(inputs_of(backbone, 1))  # on the loop's thread it would deadlock
        # The big ones went through the bucket (it exists only once used); nothing is left.
        store = await js.object_store(subjects.feature_bucket("tiny"))
        with pytest.raises(NotFoundError):
            await store.list(ignore_deletes=True)

        # Refusals name what is wrong and are not retried.
        with pytest.raises(EncodeRefused, match="feature_layer: 1 asked of a backbone serving"):
            await ask(inputs_of(backbone, 2), feature_layer=1)
        for data, expect in (
            (b"\x93not-msgpack", "encode request: Expected `object`"),
            (b"\x81\xa4type\xa6encode", "missing required field"),
        ):
            reply = decode(
                ENCODE_REPLY_DECODER,
                (await nc.request(subjects.features_encode("tiny"), data, timeout=5)).data,
            )
            assert isinstance(reply, EncodeError) and not reply.retryable
            assert expect in reply.message, reply.message
        ids = ["0", "1"]
        full = to_encode_request(inputs_of(backbone, 2), layer, ids)
        u8 = to_encode_request(inputs_of(backbone, 2, uint8_pixels=True), layer, ids)
        cropped = Tensor.from_torch(u8.tensors[PIXELS_U8].to_torch()[:, :, :8])
        for tensors, expect in (
            (_without(full.tensors, "input_ids"), r"tensors: missing \['input_ids'\]"),
            (_without(full.tensors, "pixel_values"), r"expected exactly one of .*, got none"),
            (
                {**full.tensors, PIXELS_U8: u8.tensors[PIXELS_U8]},
                r"got \['pixel_values', 'pixels_u8'\]",
            ),
            ({**u8.tensors, PIXELS_U8: cropped}, r"pixels_u8: expected uint8 \(2, 1, "),
        ):
            with pytest.raises(EncodeRefused, match=expect):
                await client.request(msgspec.structs.replace(full, tensors=tensors))
        # A record of another layer than asked for is never handed to a head.
        record = await ask(inputs_of(backbone, 2))
        with pytest.raises(FeatureRecordError, match="expected"):
            WireEncoder(lambda _request: record, 1).encode(inputs_of(backbone, 2))
        assert proc.poll() is None
    finally:
        await nc.close()
        server.kill()


@pytest.mark.timeout(240)
@pytest.mark.stack
async def test_a_head_only_trainer_reaches_the_in_process_parameters_across_a_backbone_kill(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    url = fresh_server.url
    nc = await connect(url)
    js = nc.jetstream()
    await declare(js)
    logs = tmp_path
    procs.add(start_service("master", url, logs / "master.log"))
    backbone = procs.add(start_service("backbone", url, logs / "backbone-0.log"))
    trainer_log = logs / "trainer.log"
    procs.add(start_service("trainer", url, trainer_log, "--deterministic", "--backbone-service"))
    procs.add(start_service("inferencer", url, logs / "inferencer.log", "--backbone-service"))
    tenant = uid("split")
    service = await ServiceClient.connect(url, tenant=tenant)
    try:
        training = await service.create_training_client(head=HEAD, token_budget=TOKEN_BUDGET)
        plan = Plan(iterations=4)

        def send(group: list[VLABatch]) -> list[asyncio.Future[CallOutput]]:
            sent = [training.forward_backward(b) for b in group]
            return [*sent, training.optim_step(AdamParams(plan.lr, grad_clip=1.0))]

        groups = plan.batches()
        first = await asyncio.wait_for(asyncio.gather(*send(groups[0])), 120)
        # The backbone role dies mid-session: the calls sent now find none and are handed
        # back (nothing applied), until a new one starts.
        backbone.send_signal(signal.SIGKILL)
        backbone.wait(10)
        rest = [f for group in groups[1:] for f in send(group)]
        await eventually(
            lambda: "handed back" in trainer_log.read_text(), 60, what="a call handed back"
        )
        procs.add(start_service("backbone", url, logs / "backbone-1.log"))
        outputs = [*first, *await asyncio.wait_for(asyncio.gather(*rest), 180)]
        assert [o.call for o in outputs] == list(range(3 * len(groups)))
        ref_losses, ref_slot = reference(plan)
        assert [o.loss for o in outputs if o.op == "forward_backward"] == ref_losses
        saved = await training.save_state("split-4")
        assert saved.version >= 1
        assert_same_slot(await saved_slot(js, tenant, training.session_id), ref_slot)

        sampling = await training.save_weights_and_get_sampling_client("for-sampler")
        obs = observation([np.zeros((32, 32, 3), np.uint8)], "reach", np.zeros(4, np.float32))
        sampled = await sampling.sample(obs, 3, seed=1)
        assert sampled.actions.shape == (3, 4, 2) and sampled.version == sampling.version
        await training.close()
    finally:
        await service.close()
        await nc.close()
    text = trainer_log.read_text()
    assert "released its weights" not in text  # the trainer never tried to encode itself


def test_the_launcher_runs_the_backbone_role_and_head_only_roles_when_asked(
    tmp_path: Path,
) -> None:
    from services.launcher import LocalStack

    plain = LocalStack(tmp_path, roles={"master": 1, "trainer": 1})
    assert "backbone" not in plain.roles and "backbone" not in plain.expected_roles
    assert "--backbone-service" not in plain.args_of("trainer", plain.backbones[0])
    split = LocalStack(tmp_path, roles={"master": 1, "trainer": 1}, backbone_service=True)
    assert split.roles == {"master": 1, "trainer": 1, "backbone": 1}
    assert split.expected_roles[-1] == "backbone"
    served = split.backbones[0]
    for role in ("trainer", "inferencer"):
        assert "--backbone-service" in split.args_of(role, served)
    backbone_args = split.args_of("backbone", served)
    assert "--backbone-service" not in backbone_args and "--backbone-id" in backbone_args


@pytest.mark.timeout(120)
async def test_an_answer_the_feature_bucket_refuses_is_a_retryable_refusal_not_a_crash(
    tmp_path: Path, procs: Procs
) -> None:
    """An answer over max_payload goes through the feature bucket; a bucket that refused it
    (full here; a slow or leaderless store alike) crashed the role, answering no one."""
    server = EmbeddedServer(tmp_path / "nats", max_payload=128 * 1024).start()
    nc = await connect(server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        await js.create_object_store(subjects.feature_bucket("tiny"), max_bytes=1024)
        backbone = Backbone.load("tiny")
        client = FeatureClient(nc, js, asyncio.get_running_loop(), "tiny", timeout_s=5)
        proc = procs.add(start_service("backbone", server.url, tmp_path / "backbone.log"))

        def ask(inputs: ModelInputs) -> Awaitable[FeatureRecord]:
            ids = [str(i) for i in range(inputs.batch_size)]
            return client.request(to_encode_request(inputs, backbone.feature_layer, ids))

        await until_answering(client, backbone)
        # Long instructions under a large token budget: a small request (inline), an answer
        # of ~140 KiB of features, more than one message holds.
        rng = np.random.default_rng(0)
        size = backbone.image_size
        wordy = Normaliser(backbone, 1, 256).normalise_arrays(
            rng.integers(0, 255, (1, 1, size, size, 3), dtype=np.uint8),
            [" ".join(["push the block"] * 400)],
            rng.standard_normal((1, 4)).astype(np.float32),
        )
        with pytest.raises(BackboneUnavailable, match="the feature bucket refused it"):
            await ask(wordy)
        assert proc.poll() is None
        assert isinstance(await ask(inputs_of(backbone, 2)), FeatureRecord)  # still serving
    finally:
        await nc.close()
        server.kill()
