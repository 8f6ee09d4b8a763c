"""One multi-tensor clip + AdamW step over many tenants equals each tenant's own
``clip_grad_norm_`` + ``torch.optim.AdamW.step`` — bit for bit, over several steps with
different hyper-parameters, schedules and clipping, on real heads. Gradients given as one
flat row per tenant (as a batched backward leaves them) step with the same bits, and are
clipped by the row's norm, equal to ``clip_grad_norm_``'s up to float rounding."""

from __future__ import annotations

import math

import pytest
import torch

from schemas.model import HeadConfig, OptimizerConfig
from vla.feature import VLAFeature
from vla.flatparams import assign_grads, flat_of
from vla.multiopt import adamw_step, clip_grad_norms, supported
from vla.slot import TenantSlot, lr_at

HIDDEN = 32
T = 5
#: Different kinds, sizes, schedules, betas, decay and clipping (0 = none; 0.05 clips hard).
TENANTS = [
    (
        HeadConfig(kind="oft", action_dim=7, chunk_len=4, proprio_dim=7),
        OptimizerConfig(lr=3e-3, weight_decay=0.01, warmup_steps=2, total_steps=6),
    ),
    (
        HeadConfig(kind="discrete", action_dim=3, chunk_len=2, num_bins=16),
        OptimizerConfig(lr=1e-2, betas=(0.8, 0.99), grad_clip=0.05),
    ),
    (
        HeadConfig(kind="flow", action_dim=4, chunk_len=3, proprio_dim=2),
        OptimizerConfig(lr=5e-4, betas=(0.95, 0.9), weight_decay=0.1, grad_clip=0.0),
    ),
    (
        HeadConfig(kind="oft", action_dim=7, chunk_len=4, proprio_dim=7, value_head=True),
        OptimizerConfig(lr=2e-3, total_steps=4, min_lr_ratio=0.1, grad_clip=0.5),
    ),
]
STEPS = 5


def batch(head: HeadConfig, seed: int) -> tuple[VLAFeature, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B = 2
    prefix = torch.randn(B, T, HIDDEN, generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    proprio = torch.randn(B, head.proprio_dim, generator=g)
    actions = torch.rand(B, head.chunk_len, head.action_dim, generator=g) * 2 - 1
    return VLAFeature(prefix, mask, proprio), actions


def slots() -> list[TenantSlot]:
    return [TenantSlot(f"t{i}", h, o, HIDDEN, seed=i) for i, (h, o) in enumerate(TENANTS)]


def backward(slot: TenantSlot, step: int, index: int) -> None:
    feature, actions = batch(slot.head_config, 1000 * index + step)
    slot.optimizer.zero_grad(set_to_none=True)
    slot.module.loss(feature, actions, generator=slot.generator).backward()


def assert_same_state(a: TenantSlot, b: TenantSlot) -> None:
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


def own_steps_beside(own: list[TenantSlot], other: list[TenantSlot], step: int) -> None:
    """Gradients of ``step`` for both lists of slots; each ``own`` slot then takes its own
    ``AdamW.step`` (the reference), ``other`` is left for the caller to step."""
    for i, (a, b) in enumerate(zip(own, other, strict=True)):
        backward(a, step, i)
        backward(b, step, i)
        a.optimizer.step()


@pytest.fixture(autouse=True)
def deterministic() -> object:
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_shared_clip_and_adamw_equal_each_tenants_own_step_bitwise() -> None:
    own, shared = slots(), slots()
    for step in range(STEPS):
        own_norms = []
        for i, s in enumerate(own):
            backward(s, step, i)
            clip = s.optim_config.grad_clip if s.optim_config.grad_clip > 0 else math.inf
            own_norms.append(float(torch.nn.utils.clip_grad_norm_(s.module.parameters(), clip)))
            for group in s.optimizer.param_groups:
                group["lr"] = lr_at(s.optim_config, step)
            s.optimizer.step()
        for i, s in enumerate(shared):
            backward(s, step, i)
            for group in s.optimizer.param_groups:
                group["lr"] = lr_at(s.optim_config, step)
        norms = clip_grad_norms(
            [list(s.module.parameters()) for s in shared],
            [s.optim_config.grad_clip or math.inf for s in shared],
        )
        adamw_step([s.optimizer for s in shared])
        assert norms == own_norms, step
        for a, b in zip(own, shared, strict=True):
            assert_same_state(a, b)
    # The hyper-parameters mattered: clipping happened, and the tenants moved differently.
    assert any(n > 0.05 for n in own_norms)
    assert len({float(s.optimizer.param_groups[0]["lr"]) for s in own}) == len(own)


def test_a_later_own_step_continues_from_the_shared_state() -> None:
    """State written by the shared step is the optimizer's own: a plain ``step()`` next
    (a tenant served alone) continues exactly as if every step had been its own."""
    own, shared = slots(), slots()
    for step in range(3):
        own_steps_beside(own, shared, step)
        if step < 2:
            adamw_step([s.optimizer for s in shared])
        else:
            for s in shared:
                s.optimizer.step()
    for a, b in zip(own, shared, strict=True):
        assert_same_state(a, b)


def test_parameters_without_grad_are_skipped_like_adamw_skips_them() -> None:
    own, shared = slots()[:1], slots()[:1]
    for s in own + shared:
        backward(s, 0, 0)
        s.module.queries_C_H.grad = None  # e.g. a frozen or unused parameter this step
    own[0].optimizer.step()
    adamw_step([shared[0].optimizer])
    assert_same_state(own[0], shared[0])
    assert shared[0].module.queries_C_H not in shared[0].optimizer.state


def test_unsupported_optimizers_are_stepped_on_their_own() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    ams = torch.optim.AdamW([p], lr=0.1, amsgrad=True)
    ref = torch.optim.AdamW([q], lr=0.1, amsgrad=True)
    assert not supported(ams)
    p.grad = torch.full((3,), 0.5)
    q.grad = torch.full((3,), 0.5)
    adamw_step([ams])
    ref.step()
    assert torch.equal(p, q)


def test_clip_norms_reject_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 tenants but 1 max norms"):
        clip_grad_norms([[], []], [1.0])


def flat_moments(slot: TenantSlot) -> set[int]:
    """The storages under the slot's AdamW moments (one: they are views of flat tensors)."""
    state = slot.optimizer.state
    return {
        state[p][k].untyped_storage().data_ptr()
        for p in slot.module.parameters()
        if p in state
        for k in ("exp_avg", "exp_avg_sq")
    }


def test_the_shared_step_keeps_a_tenants_moments_in_two_flat_tensors() -> None:
    """What makes the shared step cheap: parameters and moments are views of flat tensors,
    so a tenant is a few tensors in each multi-tensor call, not one per parameter."""
    (s,) = slots()[:1]
    params = list(s.module.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    backward(s, 0, 0)
    adamw_step([s.optimizer])
    assert len(flat_moments(s)) == 2
    # Every parameter with a gradient was stepped (an OFT head's log-std has none in SFT).
    assert len(s.optimizer.state) == sum(p.grad is not None for p in params) == len(params) - 1


def test_a_restored_slot_continues_bitwise_and_goes_flat_again() -> None:
    """A checkpoint's state (separate tensors once loaded) is copied into the flat moments
    at the next shared step; the trajectory is the same bits as torch's own steps."""
    own, shared = slots(), slots()
    for step in range(2):
        own_steps_beside(own, shared, step)
        adamw_step([s.optimizer for s in shared])
    restored = [TenantSlot.from_bytes(s.to_bytes()) for s in shared]
    for step in range(2, 4):
        own_steps_beside(own, restored, step)
        adamw_step([s.optimizer for s in restored])
    for a, b in zip(own, restored, strict=True):
        assert_same_state(a, b)
        assert len(flat_moments(b)) == 2


def test_a_parameter_that_starts_late_keeps_its_own_step_count() -> None:
    """A parameter without gradients for a while (a value head during SFT) joins later at
    step 1 while the others are further on: its bias correction is its own, as in AdamW."""
    own, shared = slots()[3:], slots()[3:]
    for step in range(3):
        for a, b in zip(own, shared, strict=True):
            backward(a, step, 3)
            backward(b, step, 3)
            if step == 2:  # now the value head learns too
                for s in (a, b):
                    for p in s.module.parameters():
                        if p.grad is None:
                            p.grad = torch.full_like(p, 0.1)
            a.optimizer.step()
        adamw_step([s.optimizer for s in shared])
    for a, b in zip(own, shared, strict=True):
        assert_same_state(a, b)
        steps = {float(st["step"]) for st in b.optimizer.state.values()}
        assert steps == {1.0, 3.0}


def as_row(slot: TenantSlot) -> None:
    """Make the slot's gradients views of one flat row, as a batched backward leaves them."""
    params = list(slot.module.parameters())
    present = [p.grad is not None for p in params]
    row = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )
    assign_grads(params, row, present)
    assert len({p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}) == 1
    assert [p.grad is not None for p in params] == present


def max_norms(slots: list[TenantSlot]) -> list[float]:
    return [s.optim_config.grad_clip or math.inf for s in slots]


def test_a_flat_gradient_row_steps_bitwise_as_separate_gradients() -> None:
    """AdamW reads a tenant's gradient row as one tensor per run: the same elementwise
    arithmetic as over its separate gradients, so the same bits (no clipping here, whose
    norm differs in rounding: next test)."""
    own, shared = slots(), slots()
    for step in range(STEPS):
        for i, (a, b) in enumerate(zip(own, shared, strict=True)):
            backward(a, step, i)
            backward(b, step, i)
            as_row(b)
        inf = [math.inf] * len(own)
        assert clip_grad_norms([list(s.module.parameters()) for s in shared], inf) == (
            pytest.approx(clip_grad_norms([list(s.module.parameters()) for s in own], inf))
        )
        adamw_step([s.optimizer for s in own])
        adamw_step([s.optimizer for s in shared])
        for a, b in zip(own, shared, strict=True):
            assert_same_state(a, b)


def test_a_flat_gradient_row_is_clipped_by_its_norm_as_clip_grad_norm_does() -> None:
    """A row's norm is one kernel over the row: ``clip_grad_norm_``'s value up to float
    rounding, and the clipped gradients match to that. A gradient replaced since (no longer
    a view of the row) sends the tenant back to the per-tensor norm, bit for bit torch's."""
    own, shared = slots(), slots()
    for i, (a, b) in enumerate(zip(own, shared, strict=True)):
        backward(a, 0, i)
        backward(b, 0, i)
        as_row(b)
    own_norms = [
        float(torch.nn.utils.clip_grad_norm_(s.module.parameters(), m))
        for s, m in zip(own, max_norms(own), strict=True)
    ]
    norms = clip_grad_norms([list(s.module.parameters()) for s in shared], max_norms(shared))
    assert norms == pytest.approx(own_norms, rel=1e-6)
    assert any(n > m for n, m in zip(own_norms, max_norms(own), strict=True))  # clipping ran
    for a, b in zip(own, shared, strict=True):
        for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
            assert (pa.grad is None) == (pb.grad is None)
            if pa.grad is not None:
                torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-6, atol=1e-9)

    own, shared = slots(), slots()
    for i, (a, b) in enumerate(zip(own, shared, strict=True)):
        backward(a, 1, i)
        backward(b, 1, i)
        as_row(b)
        b.module.out_proj.weight.grad = b.module.out_proj.weight.grad.clone()
    own_norms = [
        float(torch.nn.utils.clip_grad_norm_(s.module.parameters(), m))
        for s, m in zip(own, max_norms(own), strict=True)
    ]
    assert clip_grad_norms([list(s.module.parameters()) for s in shared], max_norms(shared)) == (
        own_norms
    )


def test_assign_grads_checks_the_row_and_leaves_absent_gradients_none() -> None:
    (s,) = slots()[:1]
    params = list(s.module.parameters())
    total = sum(p.numel() for p in params)
    present = [i != 0 for i in range(len(params))]
    assign_grads(params, torch.ones(total), present)
    assert params[0].grad is None
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params[1:])
    with pytest.raises(ValueError, match=rf"row of shape \({total - 1},\) for {total} parameter"):
        assign_grads(params, torch.ones(total - 1), present)


def test_the_row_is_read_whole_until_a_gradient_is_replaced_or_dropped() -> None:
    """The row a step reads is exactly the tenant's gradients (zeros where a parameter has
    none); a gradient replaced or dropped since means there is no row to read."""
    (s,) = slots()[:1]
    params = list(s.module.parameters())
    backward(s, 0, 0)
    expected = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )
    as_row(s)
    record = flat_of(params)
    assert record is not None
    row = record.flat_grad()
    assert row is not None and torch.equal(row, expected)
    assert row.data_ptr() == params[0].grad.data_ptr()  # the same memory, not a copy
    params[1].grad = params[1].grad.clone()
    assert record.flat_grad() is None
    as_row(s)
    assert record.flat_grad() is not None
    s.optimizer.zero_grad(set_to_none=True)
    assert record.flat_grad() is None
