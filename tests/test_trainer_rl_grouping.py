"""The trainer's RL iterations share one backbone forward; when that forward fails, only the
job at fault fails (the real tiny backbone, the trainer's own :func:`update_iterations`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bus.errors import RetryableError
from schemas.model import HeadConfig, OptimizerConfig
from schemas.tensor import Tensor
from schemas.train import PPOConfig, RolloutBatch
from services.trainer.rl import Iteration, update_iterations
from vla.backbone import Backbone
from vla.feature import ModelInputs, VLAFeature
from vla.normalize import Normaliser
from vla.slot import TenantSlot

torch.set_num_threads(1)

IMAGE = 16


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.load("tiny")


def episode(job: str, steps: int, seed: int) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return RolloutBatch(
        "acme",
        job,
        0,
        0,
        0,
        Tensor.from_numpy(rng.integers(0, 255, (steps, 1, IMAGE, IMAGE, 3), dtype=np.uint8)),
        "reach",
        Tensor.from_numpy(rng.standard_normal((steps, 3)).astype(f32)),
        Tensor.from_numpy(rng.uniform(-1, 1, (steps, 1, 2)).astype(f32)),
        Tensor.from_numpy(np.full(steps, -1.0, f32)),
        Tensor.from_numpy(np.zeros(steps, f32)),
        Tensor.from_numpy(rng.standard_normal(steps).astype(f32)),
        terminated=True,
        truncated=False,
    )


def iteration(backbone: Backbone, job: str, steps: int) -> Iteration:
    head = HeadConfig(kind="oft", action_dim=2, proprio_dim=3, hidden_dim=32, value_head=True)
    slot = TenantSlot("acme", head, OptimizerConfig(lr=1e-3), backbone.hidden_size, seed=1)
    return Iteration(
        key=f"acme.{job}",
        slot=slot,
        normaliser=Normaliser(backbone, num_views=1, token_budget=8),
        config=PPOConfig(epochs=1, minibatch_size=64, episodes_per_iteration=1),
        episodes=[episode(job, steps, seed=steps)],
        policy_version=0,
    )


class OddBatchesFail:
    """The real backbone, except that a batch of an odd number of samples raises
    (``error``), as an input the backbone cannot take would."""

    def __init__(self, backbone: Backbone, error: Exception) -> None:
        self.backbone = backbone
        self.error = error
        self.calls: list[int] = []

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        self.calls.append(inputs.batch_size)
        if inputs.batch_size % 2:
            raise self.error
        return self.backbone.encode(inputs)


def test_a_shared_forward_that_fails_fails_only_the_job_at_fault(backbone: Backbone) -> None:
    good, bad = iteration(backbone, "good", steps=2), iteration(backbone, "bad", steps=3)
    encoder = OddBatchesFail(backbone, ValueError("the backbone cannot take this input"))
    before = [p.detach().clone() for p in good.slot.module.parameters()]

    results = update_iterations(encoder, [good, bad])

    assert encoder.calls == [5, 2, 3]  # the group, then each job alone
    assert isinstance(results[bad.key], ValueError)
    metrics = results[good.key]
    assert isinstance(metrics, dict) and np.isfinite(metrics["return_mean"])
    after = list(good.slot.module.parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))


def test_a_retryable_shared_forward_failure_hands_every_job_back_at_once(
    backbone: Backbone,
) -> None:
    """A backbone that did not answer is no job's fault: one try, every job gets the
    retryable error, none is retried alone (each would wait out the same timeout)."""
    first, second = iteration(backbone, "one", steps=2), iteration(backbone, "two", steps=3)
    encoder = OddBatchesFail(backbone, RetryableError("backbone did not answer within 5 s"))
    before = [p.detach().clone() for p in first.slot.module.parameters()]

    results = update_iterations(encoder, [first, second])

    assert encoder.calls == [5]
    assert all(isinstance(results[it.key], RetryableError) for it in (first, second))
    after = list(first.slot.module.parameters())
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
