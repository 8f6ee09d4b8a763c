"""Regenerate the golden encodings: ``python -m tests.golden.regen``. Only run this for an
intended schema change, and review the diff: existing bytes must keep decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bus.codec import encode
from schemas.dead import DeadLetter
from schemas.env import EvalTask, RolloutTask, StreamDataset
from schemas.events import (
    Accepted,
    CallResult,
    PolicyPublished,
    Progress,
    Rejected,
    StateChanged,
)
from schemas.feature import FeatureRecord, FeatureRef
from schemas.health import Heartbeat
from schemas.infer import ActReply, ActRequest
from schemas.jobs import JobCancel, JobRecord, JobSubmit
from schemas.model import HeadConfig, Observation, OptimizerConfig
from schemas.tensor import Tensor
from schemas.train import (
    CloseSlot,
    ForwardBackward,
    LoadState,
    OpenSlot,
    OptimStep,
    PolicyRecord,
    PPOConfig,
    RolloutBatch,
    SaveState,
    SFTBatch,
)

HERE = Path(__file__).parent


def _f32(*shape: int) -> Tensor:
    """A float32 tensor of exactly representable values (0, 0.25, 0.5 ...)."""
    return Tensor.from_numpy(np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 4)


def _u8(*shape: int) -> Tensor:
    return Tensor.from_numpy((np.arange(np.prod(shape)) % 256).astype(np.uint8).reshape(shape))


#: Every optional field set away from its default, so a retyped or reordered field shows.
_OPEN_SLOT = OpenSlot(
    "acme",
    "sft-0001",
    HeadConfig("flow", action_dim=7, chunk_len=4, proprio_dim=8, flow_steps=4),
    OptimizerConfig(lr=0.0005, warmup_steps=10, total_steps=100, min_lr_ratio=0.125),
    seed=7,
    total_steps=100,
    num_views=2,
    token_budget=32,
    checkpoint_every=5,
    priority=2,
    init_object="acme/sft-0000/v3",
    init_sha256="ab" * 32,
)
_RL_SLOT = OpenSlot(
    "acme",
    "rl-0001",
    HeadConfig("oft", action_dim=2, chunk_len=1, proprio_dim=2, value_head=True),
    OptimizerConfig(lr=0.00025, total_steps=8),
    seed=3,
    total_steps=8,
    checkpoint_every=1,
    rl=PPOConfig(algorithm="grpo", epochs=2, episodes_per_iteration=16, max_policy_lag=1),
)
_OBSERVATION = Observation([_u8(2, 2, 3)], "reach the target", _f32(2))

SAMPLES: dict[str, object] = {
    "job_submit": JobSubmit("acme", "sft-0001", b'{"kind":"sft"}', 1767225600.0),
    "job_cancel": JobCancel("acme", "sft-0001", "no longer needed"),
    "job_record": JobRecord(
        "acme",
        "sft-0001",
        "sft",
        "running",
        b'{"kind":"sft"}',
        1767225600.0,
        1767225601.5,
        "",
        {"loss": 0.25},
        3,
    ),
    "event_accepted": Accepted("acme", "sft-0001", "sft", 1767225600.0),
    "event_rejected": Rejected("acme", "sft-0001", "head.action_dim: too small", 1767225600.0),
    "event_state": StateChanged("acme", "sft-0001", "succeeded", 1767225600.0),
    "event_progress": Progress("acme", "sft-0001", 5, 10, {"loss": 0.5}, 1767225600.0),
    "event_policy": PolicyPublished("acme", "sft-0001", 2, "acme/sft-0001/v2", 20, 1767225600.0),
    "heartbeat": Heartbeat(
        "master", "master-a-1", 1234, "host", 1767225600.0, 1767225601.0, "0.1.0", 2, {"lag": 1.0}
    ),
    "dead_letter": DeadLetter(
        "JOBS",
        "nexus.job.acme.submit",
        "master",
        7,
        1,
        "PoisonError: bad",
        "PoisonError",
        b"\x01\x02",
        1767225600.0,
        "acme",
    ),
    "tensor_f32": Tensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3)),
    "head_config": HeadConfig("oft", action_dim=7, chunk_len=4, proprio_dim=8),
    "observation": Observation(
        [Tensor.from_numpy(np.zeros((2, 2, 3), dtype=np.uint8))],
        "push the cube",
        Tensor.from_numpy(np.ones(3, dtype=np.float32)),
    ),
    "open_slot": _OPEN_SLOT,
    "close_slot": CloseSlot("acme", "sft-0001", "succeeded"),
    "sft_batch": SFTBatch(
        "acme",
        "sft-0001",
        step=3,
        epoch=1,
        batch_index=2,
        images=_u8(2, 1, 2, 2, 3),
        instructions=["push the cube", "lift the cube"],
        proprio=_f32(2, 3),
        actions=_f32(2, 2, 3),
        action_pad=Tensor.from_numpy(np.array([[False, False], [False, True]])),
    ),
    "forward_backward": ForwardBackward(
        "acme",
        "session-0001",
        call=4,
        images=_u8(2, 1, 2, 2, 3),
        instructions=["push the cube", "lift the cube"],
        proprio=_f32(2, 3),
        actions=_f32(2, 2, 3),
        loss_fn="ppo",
        advantages=Tensor.from_numpy(np.array([0.5, -1.0], dtype=np.float32)),
    ),
    "optim_step": OptimStep("acme", "session-0001", call=5, learning_rate=1e-3, grad_clip=1.0),
    "save_state": SaveState("acme", "session-0001", call=6, name="iter-1", for_sampler=True),
    "load_state": LoadState("acme", "session-0001", call=7, name="iter-1"),
    "event_call": CallResult(
        "acme", "session-0001", 4, "forward_backward", {"loss": 0.25, "samples": 2.0}, 1767225600.0
    ),
    "feature_record": FeatureRecord(
        backbone_id="tiny",
        feature_layer=2,
        image_size=32,
        num_views=1,
        token_budget=16,
        dtype="bfloat16",
        sample_ids=["a1b2", "c3d4"],
        prefix=Tensor("bfloat16", (2, 3, 4), bytes(range(48))),
        mask=Tensor.from_numpy(np.array([[True, True, False], [True, True, True]])),
        proprio=_f32(2, 3),
    ),
    "feature_ref": FeatureRef(
        backbone_id="tiny",
        feature_layer=2,
        image_size=32,
        num_views=1,
        token_budget=16,
        sample_ids=["a1b2", "c3d4"],
        bucket="features-tiny",
        object_name="2/" + "ab" * 32,
        size=2_000_000,
        sha256="ab" * 32,
    ),
    "rollout_batch": RolloutBatch(
        "acme",
        "rl-0001",
        iteration=4,
        episode=1,
        policy_version=4,
        images=_u8(3, 1, 2, 2, 3),
        instruction="reach the target",
        proprio=_f32(3, 2),
        actions=_f32(3, 1, 2),
        log_probs=_f32(3),
        values=_f32(3),
        rewards=_f32(3),
        terminated=False,
        truncated=True,
        success=True,
        bootstrap_value=0.5,
    ),
    "policy_record": PolicyRecord(
        "acme",
        "rl-0001",
        version=4,
        step=4,
        object_name="acme/rl-0001/v4",
        sha256="cd" * 32,
        stream_seq=1234,
        slot=_RL_SLOT,
        at=1767225600.0,
        metrics={"return": 0.5, "loss": 0.25},
        batches_done=64,
        saved={"after-3": "acme/rl-0001/v000003-" + "ef" * 8},
        saved_calls={"after-3": 41},
    ),
    "act_request": ActRequest(
        "acme",
        "rl-0001",
        "req-0001",
        "_INBOX.acme.abc",
        [_OBSERVATION, _OBSERVATION],
        policy_version=3,
        deterministic=True,
        seed=11,
        num_views=1,
        token_budget=24,
        sent_at=1767225600.0,
    ),
    "act_reply": ActReply(
        "req-0001",
        3,
        actions=_f32(2, 1, 2),
        log_probs=_f32(2),
        values=_f32(2),
        group_size=3,
    ),
    "act_reply_error": ActReply("req-0002", 0, error="no committed policy for acme/rl-0009"),
    "act_reply_retryable": ActReply(
        "req-0003",
        2,
        error="gave up after 3 deliveries: checkpoint store unavailable",
        retryable=True,
    ),
    "env_stream_dataset": StreamDataset(
        "acme",
        "sft-0001",
        "tiny",
        "acme/reach",
        batch_size=8,
        total_steps=100,
        chunk_len=4,
        num_views=2,
        seed=5,
        proprio_dim=3,
        val_fraction=0.25,
        max_in_flight=6,
    ),
    "env_rollout_task": RolloutTask(
        "acme",
        "rl-0001",
        "tiny",
        "JoyNexus/Reach2D-v0",
        iteration=4,
        first_episode=8,
        episodes=8,
        policy_version=4,
        seed=9,
        max_episode_steps=40,
        image_size=32,
        num_views=2,
        token_budget=24,
        proprio_dim=2,
        parallel_envs=8,
        env_kwargs={"target_in_state": True, "goal_radius": 0.125, "layout": "fixed", "n": 3},
        same_reset=True,
    ),
    "env_eval_task": EvalTask(
        "acme",
        "eval-0001",
        "tiny",
        policy_job="sft-0001",
        policy_version=2,
        episodes=16,
        seed=13,
        dataset="acme/reach",
        max_episode_steps=60,
        image_size=32,
        num_views=2,
        token_budget=24,
        proprio_dim=3,
        val_fraction=0.25,
        parallel_envs=2,
        chunk_len=4,
        env_kwargs={"noise": 0.5},
    ),
}

if __name__ == "__main__":
    for name, message in SAMPLES.items():
        (HERE / f"{name}.msgpack").write_bytes(encode(message))
    print(f"wrote {len(SAMPLES)} golden samples to {HERE}")
