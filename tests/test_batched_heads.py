"""Batched heads on the real tiny backbone: tenants whose heads share an architecture train
through one stacked head forward/backward and one shared AdamW step, and each still takes
exactly the losses and reaches exactly the parameters of its own serial run (bit for bit
where this machine's kernels give a sample the same bits alone as in a batch, else up to
float32 rounding: :mod:`tests.numerics`; a tenant alone is a stack of one, and a slice of a
batched kernel does not depend on the others), for every head kind and for mixed rounds;
one tenant's NaN or exception leaves every other tenant's parameters and optimizer state as
they would be. The stacked
formulation computes the same function as each head module's own ``loss`` (within 1e-5)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import vla.batched
from schemas.model import HeadConfig, OptimizerConfig
from tests.numerics import assert_same_results, assert_same_state
from vla.backbone import Backbone
from vla.feature import ModelInputs, VLAFeature
from vla.grouping import TrainRequest, group_train_step, serial_train_step
from vla.normalize import Normaliser
from vla.slot import NonFiniteLossError, StepResult, TenantSlot

torch.set_num_threads(1)

STEPS = 4
TOL = 1e-6
INSTRUCTIONS = ["pick up the red block", "open the drawer", "push the cube to the left"]
OFT = HeadConfig(kind="oft", action_dim=7, chunk_len=4, proprio_dim=7)
DISCRETE = HeadConfig(kind="discrete", action_dim=3, chunk_len=2, num_bins=16)
FLOW = HeadConfig(kind="flow", action_dim=4, chunk_len=3, proprio_dim=5)
OFT_VALUE = HeadConfig(kind="oft", action_dim=2, chunk_len=2, proprio_dim=3, value_head=True)
#: Per-tenant optimizers differ (lr, betas, decay, clipping, schedule) inside one batch.
OPTIMS = [
    OptimizerConfig(lr=1e-3, weight_decay=0.01, warmup_steps=2, total_steps=8),
    OptimizerConfig(lr=2e-3, betas=(0.8, 0.99), grad_clip=0.05),
    OptimizerConfig(lr=5e-4, weight_decay=0.1, grad_clip=0.0, total_steps=3),
]


@dataclass(frozen=True)
class Tenant:
    name: str
    head: HeadConfig
    optim: OptimizerConfig
    local_batch: int = 2


def same_arch(head: HeadConfig, n: int = 3) -> list[Tenant]:
    return [Tenant(f"{head.kind}{i}", head, OPTIMS[i % len(OPTIMS)]) for i in range(n)]


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.load("tiny")


@pytest.fixture(scope="module")
def normaliser(backbone: Backbone) -> Normaliser:
    return Normaliser(backbone, num_views=1, token_budget=16)


def make_batches(norm: Normaliser, t: Tenant, seed: int) -> list[tuple[ModelInputs, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        s = seed * 100 + step
        rng = np.random.default_rng(s)
        size = norm.key.image_size
        images = rng.integers(0, 256, (t.local_batch, 1, size, size, 3), dtype=np.uint8)
        instructions = [INSTRUCTIONS[(s + i) % 3] for i in range(t.local_batch)]
        proprio = rng.standard_normal((t.local_batch, t.head.proprio_dim)).astype(np.float32)
        g = torch.Generator().manual_seed(s)
        actions = torch.rand(t.local_batch, t.head.chunk_len, t.head.action_dim, generator=g)
        out.append((norm.normalise_arrays(images, instructions, proprio), actions * 2 - 1))
    return out


def new_slots(backbone: Backbone, tenants: list[Tenant]) -> dict[str, TenantSlot]:
    slots = {
        t.name: TenantSlot(t.name, t.head, t.optim, backbone.hidden_size, seed=i)
        for i, t in enumerate(tenants)
    }
    for i, t in enumerate(tenants):
        with_proprio_stats(slots[t.name], i)
    return slots


def with_proprio_stats(slot: TenantSlot, index: int) -> TenantSlot:
    """Give a slot its own proprio statistics (if it reads proprio) and action range (each
    tenant different), so every equivalence below also covers per-tenant normalisation."""
    p, a = slot.head_config.proprio_dim, slot.head_config.action_dim
    if p:
        slot.module.set_proprio_stats(
            [0.1 * (index + 1) * (d - 1) for d in range(p)],
            [0.5 + 0.25 * index + 0.1 * d for d in range(p)],
        )
    slot.module.set_action_stats(
        [-1.5 + 0.25 * index - 0.1 * d for d in range(a)],
        [0.5 + 0.5 * index + 0.2 * d for d in range(a)],
    )
    return slot


def snapshot(slot: TenantSlot) -> dict[str, Any]:
    sd = slot.state_dict()
    return {
        "module": {k: v.clone() for k, v in sd["module"].items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items()} for i, s in sd["optimizer"]["state"].items()
        },
        "rng": sd["rng"].clone(),
        "step": sd["step"],
    }


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest absolute difference between two snapshots; structure and counters equal."""
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        if isinstance(a[k], dict):
            worst = max(worst, max_diff(a[k], b[k]))
        elif isinstance(a[k], torch.Tensor) and a[k].is_floating_point():
            assert a[k].shape == b[k].shape, k
            worst = max(worst, float((a[k] - b[k]).abs().max()) if a[k].numel() else 0.0)
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k  # the RNG state: bit for bit
        else:
            assert a[k] == b[k], k
    return worst


Spoil = Callable[[TrainRequest, int], TrainRequest]


def run(
    backbone: Backbone,
    normaliser: Normaliser,
    tenants: list[Tenant],
    grouped: bool,
    spoil: Spoil | None = None,
) -> tuple[dict[str, list[StepResult | Exception]], dict[str, TenantSlot]]:
    """Train ``tenants`` for STEPS steps, grouped (batched heads) or each alone (serial)."""
    batches = {t.name: make_batches(normaliser, t, seed=i) for i, t in enumerate(tenants)}
    slots = new_slots(backbone, tenants)
    results: dict[str, list[StepResult | Exception]] = {t.name: [] for t in tenants}
    for step in range(STEPS):
        requests = [TrainRequest(t.name, slots[t.name], *batches[t.name][step]) for t in tenants]
        if spoil is not None:
            requests = [spoil(r, step) for r in requests]
        if grouped:
            out = group_train_step(backbone, requests)
        else:
            out = {}
            for r in requests:
                out.update(serial_train_step(backbone, [r]))
        for name, res in out.items():
            results[name].append(res)
    return results, slots


def assert_same_as_serial(
    grouped: tuple[dict[str, list[StepResult | Exception]], dict[str, TenantSlot]],
    serial: tuple[dict[str, list[StepResult | Exception]], dict[str, TenantSlot]],
    names: list[str],
) -> None:
    """Losses, grad norms, lr, step, parameters, AdamW moments and RNG: bit for bit where
    this machine allows it (:mod:`tests.numerics`)."""
    for name in names:
        assert all(isinstance(r, StepResult) for r in serial[0][name]), (name, serial[0][name])
        assert_same_results(grouped[0][name], serial[0][name], name)
        assert_same_state(snapshot(grouped[1][name]), snapshot(serial[1][name]), name)


class CountingBatched:
    """Counts the tenants of every real batched head call (the function is still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        self.inner = vla.batched.batched_backward
        monkeypatch.setattr(vla.batched, "batched_backward", self)

    def __call__(self, modules: Any, *args: Any) -> list[float]:
        self.sizes.append(len(modules))
        return self.inner(modules, *args)


# -- equivalence -----------------------------------------------------------------------------


@pytest.mark.parametrize("head", [OFT, DISCRETE, FLOW, OFT_VALUE], ids=lambda h: h.kind)
def test_each_head_kind_batched_equals_each_tenants_serial_run(
    backbone: Backbone, normaliser: Normaliser, head: HeadConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three tenants with one architecture (different seeds, data and optimizers) train as
    one batched head per step, and each matches its own serial run."""
    tenants = same_arch(head)
    serial = run(backbone, normaliser, tenants, grouped=False)
    counting = CountingBatched(monkeypatch)
    grouped = run(backbone, normaliser, tenants, grouped=True)
    assert counting.sizes == [3] * STEPS  # really batched, every step
    assert_same_as_serial(grouped, serial, [t.name for t in tenants])
    losses = [r.loss for r in grouped[0][tenants[0].name] if isinstance(r, StepResult)]
    assert len(set(losses)) == STEPS  # the steps really moved


def test_mixed_round_batches_each_architecture_and_runs_lone_heads_on_their_own(
    backbone: Backbone, normaliser: Normaliser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One round with two architectures of three and two tenants, a lone flow head and a
    same-architecture tenant with another local batch: two batched calls of 3 and 2 (and
    two stacks of one) per step, and every tenant matches its serial run."""
    lone = [
        Tenant("flow-lone", FLOW, OPTIMS[0]),
        Tenant("oft-b3", OFT, OPTIMS[1], local_batch=3),
    ]
    tenants = [*same_arch(OFT), *same_arch(DISCRETE, 2), *lone]
    serial = run(backbone, normaliser, tenants, grouped=False)
    counting = CountingBatched(monkeypatch)
    grouped = run(backbone, normaliser, tenants, grouped=True)
    assert sorted(counting.sizes) == sorted([3, 2, 1, 1] * STEPS)
    assert_same_as_serial(grouped, serial, [t.name for t in tenants])


# -- isolation -------------------------------------------------------------------------------


def nan_images(r: TrainRequest) -> TrainRequest:
    tensors = dict(r.inputs.tensors)
    tensors["pixel_values"] = torch.full_like(tensors["pixel_values"], float("nan"))
    inputs = ModelInputs(r.inputs.key, tensors, r.inputs.proprio_B_P)
    return TrainRequest(r.tenant, r.slot, inputs, r.actions_B_C_A)


@pytest.mark.parametrize("head", [OFT, DISCRETE, FLOW], ids=lambda h: h.kind)
def test_nan_in_one_batched_tenant_touches_nobody_else(
    backbone: Backbone, normaliser: Normaliser, head: HeadConfig
) -> None:
    """A tenant whose features are NaN (NaN images through the shared forward) fails every
    step with NonFiniteLossError and its slot stays at its initial state; its batch-mates
    end exactly where they end when that tenant's data is clean (bit for bit: the batched
    computation never mixes tenants), which is also their serial run."""
    tenants = same_arch(head)
    bad = tenants[1].name

    def spoil(r: TrainRequest, step: int) -> TrainRequest:
        return nan_images(r) if r.tenant == bad else r

    clean = run(backbone, normaliser, tenants, grouped=True)
    spoiled = run(backbone, normaliser, tenants, grouped=True, spoil=spoil)
    serial = run(backbone, normaliser, tenants, grouped=False)
    assert all(isinstance(r, NonFiniteLossError) for r in spoiled[0][bad]), spoiled[0][bad]
    fresh = new_slots(backbone, tenants)[bad]
    assert max_diff(snapshot(spoiled[1][bad]), snapshot(fresh)) == 0.0
    assert spoiled[1][bad].optimizer.state == {}
    others = [t.name for t in tenants if t.name != bad]
    for name in others:
        assert spoiled[0][name] == clean[0][name]
        assert max_diff(snapshot(spoiled[1][name]), snapshot(clean[1][name])) == 0.0
    assert_same_as_serial(spoiled, serial, others)


def test_exceptions_in_batched_tenants_touch_nobody_else(
    backbone: Backbone, normaliser: Normaliser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mis-shaped target fails its own tenant before the batched call; when the batched
    call itself raises, its members fall back to stacks of one, where only the tenant
    whose head raises fails: everyone else matches the serial run."""
    tenants = same_arch(OFT, 4)
    real_backward = vla.batched.batched_backward

    def explode(*args: Any, **kw: Any) -> torch.Tensor:
        raise RuntimeError("bug in a tenant's head")

    def spoil(r: TrainRequest, step: int) -> TrainRequest:
        if r.tenant == "oft0":
            return TrainRequest(r.tenant, r.slot, r.inputs, r.actions_B_C_A[:, :1])
        if r.tenant == "oft1":
            r.slot.module.stacked_loss = explode  # type: ignore[method-assign]
        return r

    def batched_fails(modules: Any, *args: Any) -> list[float]:
        if len(modules) > 1:  # e.g. out of memory for the stack: each alone still fits
            raise RuntimeError("batched head call failed")
        return real_backward(modules, *args)

    serial = run(backbone, normaliser, tenants, grouped=False)
    monkeypatch.setattr(vla.batched, "batched_backward", batched_fails)
    grouped = run(backbone, normaliser, tenants, grouped=True, spoil=spoil)
    assert all(isinstance(r, ValueError) and "(2, 1, 7)" in str(r) for r in grouped[0]["oft0"])
    assert all(isinstance(r, RuntimeError) and "bug" in str(r) for r in grouped[0]["oft1"])
    fresh = new_slots(backbone, tenants)
    for name in ("oft0", "oft1"):
        assert max_diff(snapshot(grouped[1][name]), snapshot(fresh[name])) == 0.0
    assert_same_as_serial(grouped, serial, ["oft2", "oft3"])


def test_batch_heads_off_is_the_serial_run(backbone: Backbone, normaliser: Normaliser) -> None:
    """With batched heads off (every tenant a stack of one, then the shared clip + AdamW
    step), three same-architecture tenants end where their serial runs end (bit for bit
    where this machine allows it)."""
    tenants = same_arch(FLOW)
    serial = run(backbone, normaliser, tenants, grouped=False)
    batches = {t.name: make_batches(normaliser, t, seed=i) for i, t in enumerate(tenants)}
    slots = new_slots(backbone, tenants)
    results: dict[str, list[StepResult | Exception]] = {t.name: [] for t in tenants}
    for step in range(STEPS):
        requests = [TrainRequest(t.name, slots[t.name], *batches[t.name][step]) for t in tenants]
        for name, r in group_train_step(backbone, requests, batch_heads=False).items():
            results[name].append(r)
    assert_same_as_serial((results, slots), serial, [t.name for t in tenants])


# -- the stacked formulation is the heads' own function ------------------------------------


@pytest.mark.parametrize(
    "head",
    [
        OFT,
        DISCRETE,
        FLOW,
        OFT_VALUE,
        HeadConfig(kind="discrete", action_dim=2, chunk_len=3, proprio_dim=4, num_layers=2),
        HeadConfig(kind="flow", action_dim=3, chunk_len=2, hidden_dim=33, num_layers=2),
        HeadConfig(kind="oft", action_dim=1, chunk_len=1, hidden_dim=48, num_layers=3),
    ],
    ids=lambda h: f"{h.kind}-h{h.hidden_dim}-l{h.num_layers}-p{h.proprio_dim}",
)
def test_stacked_loss_and_gradients_equal_the_modules_own_loss(head: HeadConfig) -> None:
    """Stacked over three tenants (padding in the prefix masks), each tenant's loss and
    gradients equal its module's own ``loss`` and backward within 1e-5."""
    hidden, T, B = 40, 6, 3
    slots = [
        with_proprio_stats(TenantSlot(f"t{i}", head, OPTIMS[0], hidden, seed=i), i)
        for i in range(3)
    ]
    features: list[VLAFeature] = []
    targets: list[torch.Tensor] = []
    own_losses: list[float] = []
    own_grads: list[dict[str, torch.Tensor]] = []
    for i, slot in enumerate(slots):
        g = torch.Generator().manual_seed(i)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, T - 2 :] = 0
        mask[1, 1:] = 0
        features.append(
            VLAFeature(
                torch.randn(B, T, hidden, generator=g), mask, torch.randn(B, head.proprio_dim)
            )
        )
        targets.append(torch.rand(B, head.chunk_len, head.action_dim, generator=g) * 2 - 1)
        state = slot.generator.get_state()
        loss = slot.module.loss(features[-1], targets[-1], generator=slot.generator)
        loss.backward()
        own_losses.append(float(loss.detach()))
        own_grads.append(
            {n: p.grad.clone() for n, p in slot.module.named_parameters() if p.grad is not None}
        )
        slot.optimizer.zero_grad(set_to_none=True)
        slot.generator.set_state(state)  # the stacked call draws the same noise
    draws = [s.module.draw(B, s.generator) for s in slots]
    losses = vla.batched.batched_backward([s.module for s in slots], features, targets, draws)
    for slot, value, own, grads in zip(slots, losses, own_losses, own_grads, strict=True):
        assert abs(value - own) <= 1e-5, (value, own)
        mine = {n: p.grad for n, p in slot.module.named_parameters() if p.grad is not None}
        assert mine.keys() == grads.keys()
        for n in grads:
            assert torch.allclose(mine[n], grads[n], atol=1e-5, rtol=1e-4), n


@pytest.mark.parametrize("kind", ["oft", "discrete", "flow"])
def test_a_blind_head_reads_proprio_alone(kind: str) -> None:
    """``vision=False``: two features that differ only in their prefix give a blind head the
    same loss, gradients and actions, in its own module and in the batched path."""
    head = HeadConfig(kind=kind, action_dim=2, chunk_len=2, proprio_dim=3, vision=False)
    hidden, B, T = 24, 2, 5
    g = torch.Generator().manual_seed(0)
    proprio = torch.randn(B, 3, generator=g)
    one = VLAFeature(torch.randn(B, T, hidden, generator=g), torch.ones(B, T), proprio)
    other = VLAFeature(torch.randn(B, T, hidden, generator=g), torch.ones(B, T), proprio)
    targets = torch.rand(B, 2, 2, generator=g) * 2 - 1
    losses, grads, actions = [], [], []
    for feature in (one, other):
        slot = TenantSlot("blind", head, OPTIMS[0], hidden, seed=0)
        draws = [slot.module.draw(B, slot.generator)]
        losses += vla.batched.batched_backward([slot.module], [feature], [targets], draws)
        grads.append(
            {n: p.grad.clone() for n, p in slot.module.named_parameters() if p.grad is not None}
        )
        slot.generator.manual_seed(0)
        losses.append(float(slot.module.loss(feature, targets, generator=slot.generator).detach()))
        actions.append(slot.act(feature, deterministic=True).actions_B_C_A)
    assert losses[0] == losses[2] and losses[1] == losses[3]
    assert torch.equal(actions[0], actions[1])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    seeing = TenantSlot(
        "sees",
        HeadConfig(kind=kind, action_dim=2, chunk_len=2, proprio_dim=3),
        OPTIMS[0],
        hidden,
        seed=0,
    )
    assert not torch.equal(
        seeing.act(one, deterministic=True).actions_B_C_A,
        seeing.act(other, deterministic=True).actions_B_C_A,
    )
