"""Action heads and tenant slots on random backbone features (no backbone needed)."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from torch.distributions import Categorical, Normal

from schemas.model import HeadConfig, OptimizerConfig
from vla.feature import VLAFeature
from vla.heads import ActionHead, DiscreteHead, FlowHead, OFTHead, build_head
from vla.slot import (
    NonFiniteLossError,
    SlotBudgetError,
    SlotManager,
    TenantSlot,
    lr_at,
)

torch.set_num_threads(1)

D = 32  # backbone hidden size used for the random features
KINDS = ["oft", "discrete", "flow"]


def make_feature(B: int = 4, T: int = 10, P: int = 3, seed: int = 0) -> VLAFeature:
    g = torch.Generator().manual_seed(seed)
    mask_B_T = torch.ones(B, T, dtype=torch.long)
    mask_B_T[1:, T - 3 :] = 0  # some right padding, different per row
    mask_B_T[2:, T - 5 :] = 0
    return VLAFeature(torch.randn(B, T, D, generator=g), mask_B_T, torch.randn(B, P, generator=g))


def make_actions(B: int = 4, C: int = 3, A: int = 5, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, C, A, generator=g) * 2 - 1


def config(kind: str, **kw: object) -> HeadConfig:
    base: dict[str, object] = {"action_dim": 5, "chunk_len": 3, "proprio_dim": 3}
    base.update(kw)
    return HeadConfig(kind=kind, **base)  # type: ignore[arg-type]


def params_of(slot: TenantSlot) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in slot.module.state_dict().items()}


def opt_state_of(slot: TenantSlot) -> dict[int, dict[str, torch.Tensor]]:
    return {
        i: {k: v.clone() for k, v in s.items()}
        for i, s in slot.optimizer.state_dict()["state"].items()
    }


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same_tensors(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


# -- heads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_head_shapes_and_declared_dims(kind: str) -> None:
    head = build_head(config(kind, value_head=True), D)
    feature = make_feature()
    assert (head.action_dim, head.chunk_len) == (5, 3)
    loss = head.loss(feature, make_actions(), generator=torch.Generator().manual_seed(0))
    assert loss.shape == () and math.isfinite(loss.item())
    out = head.act(feature, generator=torch.Generator().manual_seed(0))
    assert out.actions_B_C_A.shape == (4, 3, 5)
    assert out.log_prob_B.shape == (4,)
    assert out.value_B is not None and out.value_B.shape == (4,)
    assert head.log_prob(feature, out.actions_B_C_A).shape == (4,)


@pytest.mark.parametrize("kind", KINDS)
def test_loss_decreases_on_fixed_batch(kind: str) -> None:
    slot = TenantSlot("t", config(kind), OptimizerConfig(lr=3e-3), D, seed=0)
    feature, actions = make_feature(), make_actions()

    def eval_loss() -> float:
        # Same noise/time draws before and after, so the comparison is not luck (flow).
        with torch.no_grad():
            g = torch.Generator().manual_seed(99)
            return float(slot.module.loss(feature, actions, generator=g))

    before = eval_loss()
    for _ in range(15):
        slot.train_step(feature, actions)
    assert eval_loss() < 0.8 * before


def test_oft_log_prob_matches_torch_normal() -> None:
    head = build_head(config("oft"), D)
    assert isinstance(head, OFTHead)
    feature = make_feature()
    out = head.act(feature, generator=torch.Generator().manual_seed(3))
    mean_B_C_A = head.mean(feature)
    std_A = head.policy.log_std_A.exp()
    expected_B = Normal(mean_B_C_A, std_A).log_prob(out.actions_B_C_A).sum(dim=(1, 2))
    torch.testing.assert_close(out.log_prob_B, expected_B)
    torch.testing.assert_close(head.log_prob(feature, out.actions_B_C_A), expected_B)
    assert torch.isfinite(out.log_prob_B).all()
    det = head.act(feature, deterministic=True)
    torch.testing.assert_close(det.actions_B_C_A, mean_B_C_A)


def test_discrete_log_prob_matches_torch_categorical() -> None:
    head = build_head(config("discrete", num_bins=16), D)
    assert isinstance(head, DiscreteHead)
    feature = make_feature()
    out = head.act(feature, generator=torch.Generator().manual_seed(3))
    idx_B_C_A = head.bin_index(out.actions_B_C_A)
    # Sampled actions are bin centres, so binning them again returns the sampled bins.
    torch.testing.assert_close(head.bin_centres(idx_B_C_A), out.actions_B_C_A)
    expected_B = Categorical(logits=head.logits(feature)).log_prob(idx_B_C_A).sum(dim=(1, 2))
    torch.testing.assert_close(out.log_prob_B, expected_B)
    torch.testing.assert_close(head.log_prob(feature, out.actions_B_C_A), expected_B)
    det = head.act(feature, deterministic=True)
    assert torch.equal(head.bin_index(det.actions_B_C_A), head.logits(feature).argmax(-1))


def test_discrete_bins_cover_the_range() -> None:
    head = build_head(config("discrete", num_bins=4), D)
    assert isinstance(head, DiscreteHead)
    a = torch.tensor([-1.5, -1.0, -0.51, -0.49, 0.0, 0.99, 1.0, 2.0])
    assert head.bin_index(a).tolist() == [0, 0, 0, 1, 2, 3, 3, 3]


def test_flow_log_prob_is_gaussian_around_euler_sample() -> None:
    head = build_head(config("flow", flow_steps=4), D)
    assert isinstance(head, FlowHead)
    feature = make_feature()
    out = head.act(feature, generator=torch.Generator().manual_seed(3))
    mean_B_C_A = head.sample(feature)
    std_A = head.policy.log_std_A.exp()
    expected_B = Normal(mean_B_C_A, std_A).log_prob(out.actions_B_C_A).sum(dim=(1, 2))
    torch.testing.assert_close(out.log_prob_B, expected_B)
    torch.testing.assert_close(head.log_prob(feature, out.actions_B_C_A), expected_B)
    det = head.act(feature, deterministic=True)
    torch.testing.assert_close(det.actions_B_C_A, mean_B_C_A)


@pytest.mark.parametrize("kind", KINDS)
def test_log_prob_is_differentiable_for_rl(kind: str) -> None:
    head = build_head(config(kind), D)
    feature = make_feature()
    with torch.no_grad():
        actions = head.act(feature, generator=torch.Generator().manual_seed(0)).actions_B_C_A
    lp_B = head.log_prob(feature, actions)
    assert torch.isfinite(lp_B).all()
    lp_B.sum().backward()
    grads = [p.grad for p in head.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_tokens_do_not_change_the_output(kind: str) -> None:
    head = build_head(config(kind), D)
    feature = make_feature()
    scrambled = feature.prefix_B_T_D.clone()
    scrambled[feature.mask_B_T == 0] = 1e3
    other = VLAFeature(scrambled, feature.mask_B_T, feature.proprio_B_P)
    a = head.act(feature, deterministic=True).actions_B_C_A
    b = head.act(other, deterministic=True).actions_B_C_A
    torch.testing.assert_close(a, b)


def test_value_head() -> None:
    head = build_head(config("oft", value_head=True), D)
    feature = make_feature()
    v_B = head.value(feature)
    assert v_B.shape == (4,)
    v_B.sum().backward()
    assert head.value_head is not None
    assert all(p.grad is not None for p in head.value_head.parameters())
    no_value = build_head(config("oft"), D)
    assert no_value.act(feature).value_B is None
    with pytest.raises(ValueError, match="value head"):
        no_value.value(feature)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_shapes_raise_value_error_naming_expected_shape(kind: str) -> None:
    head = build_head(config(kind), D)
    feature = make_feature()
    with pytest.raises(ValueError, match=r"\(4, 3, 5\)"):
        head.loss(feature, make_actions(C=2))
    with pytest.raises(ValueError, match=r"\(4, 3, 5\)"):
        head.log_prob(feature, make_actions(A=7))
    with pytest.raises(ValueError, match=r"proprio of shape \(4, 3\)"):
        head.act(make_feature(P=2))
    with pytest.raises(ValueError, match=r"\(B, T, 48\)"):
        build_head(config(kind), 48).act(feature)


def test_heads_with_different_schemas_share_one_feature_width() -> None:
    heads: list[ActionHead] = [
        build_head(HeadConfig(kind="oft", action_dim=7, chunk_len=8, proprio_dim=8), D),
        build_head(HeadConfig(kind="discrete", action_dim=2, chunk_len=1), D),
        build_head(HeadConfig(kind="flow", action_dim=14, chunk_len=4, proprio_dim=14), D),
    ]
    for head in heads:
        feature = make_feature(P=head.proprio_dim)
        out = head.act(feature, generator=torch.Generator().manual_seed(0))
        assert out.actions_B_C_A.shape == (4, head.chunk_len, head.action_dim)


# -- slots ---------------------------------------------------------------------------------


def test_lr_schedule_warmup_then_cosine() -> None:
    cfg = OptimizerConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_at(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 4) == pytest.approx(1.0)
    assert lr_at(cfg, 9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(cfg, 14) == pytest.approx(0.1)
    assert lr_at(cfg, 100) == pytest.approx(0.1)
    assert lr_at(OptimizerConfig(lr=0.5), 1000) == 0.5


def test_slot_step_reports_loss_grad_norm_lr_and_clips() -> None:
    optim = OptimizerConfig(lr=1e-2, warmup_steps=2, grad_clip=1e-3)
    slot = TenantSlot("t", config("oft"), optim, D)
    r = slot.train_step(make_feature(), make_actions())
    assert r.step == slot.step == 1 and r.lr == pytest.approx(5e-3)
    assert r.grad_norm > 1e-3  # reported before clipping
    assert math.isfinite(r.loss)


@pytest.mark.parametrize("kind", KINDS)
def test_slot_round_trip_continues_bit_exactly(kind: str) -> None:
    optim = OptimizerConfig(lr=3e-3, weight_decay=0.01, warmup_steps=2, total_steps=10)
    slot = TenantSlot("t", config(kind), optim, D, seed=7)
    batches = [(make_feature(seed=i), make_actions(seed=10 + i)) for i in range(6)]
    for f, a in batches[:3]:
        slot.train_step(f, a)
    slot.publish_version()
    blob = slot.to_bytes()
    # The blob holds only tensors and primitives.
    torch.load(io.BytesIO(blob), weights_only=True)
    original = [slot.train_step(f, a) for f, a in batches[3:]]
    sample = slot.act(batches[0][0]).actions_B_C_A

    restored = TenantSlot.from_bytes(blob)
    assert (restored.step, restored.version, restored.tenant) == (3, 1, "t")
    again = [restored.train_step(f, a) for f, a in batches[3:]]
    assert original == again
    assert_same_tensors(params_of(slot), params_of(restored))
    assert_same_tensors(opt_state_of(slot), opt_state_of(restored))
    assert torch.equal(sample, restored.act(batches[0][0]).actions_B_C_A)


def test_slot_seed_fixes_initial_weights_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    a = TenantSlot("a", config("flow"), OptimizerConfig(), D, seed=1)
    assert torch.equal(torch.rand(3), expected)
    b = TenantSlot("b", config("flow"), OptimizerConfig(), D, seed=1)
    assert_same_tensors(params_of(a), params_of(b))


def test_nbytes_matches_measured_tensors_after_a_step() -> None:
    slot = TenantSlot("t", config("flow", value_head=True), OptimizerConfig(), D)
    before = slot.nbytes
    slot.optimizer.zero_grad()
    loss = slot.module.loss(make_feature(), make_actions(), generator=slot.generator)
    # Touch every parameter (the policy std only appears in log_prob, the value head in value).
    loss = loss + slot.module.value(make_feature()).sum()
    loss = loss + slot.module.log_prob(make_feature(), make_actions()).sum()
    loss.backward()
    grads = sum(p.grad.nbytes for p in slot.module.parameters() if p.grad is not None)
    slot.optimizer.step()
    params = sum(p.nbytes for p in slot.module.parameters())
    state = sum(
        v.nbytes for s in slot.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    assert params + grads + state == before == slot.nbytes


@pytest.mark.parametrize("kind", KINDS)
def test_nan_loss_leaves_slot_untouched(kind: str) -> None:
    slot = TenantSlot("t", config(kind), OptimizerConfig(lr=1e-2), D)
    feature, actions = make_feature(), make_actions()
    slot.train_step(feature, actions)
    params, opt, rng = params_of(slot), opt_state_of(slot), slot.generator.get_state()
    bad = actions.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):  # bad targets: rejected as input
        slot.train_step(feature, bad)
    nan_feature = VLAFeature(feature.prefix_B_T_D.clone(), feature.mask_B_T, feature.proprio_B_P)
    nan_feature.prefix_B_T_D[1, 0, 0] = float("nan")
    with pytest.raises(NonFiniteLossError, match="non-finite loss"):
        slot.train_step(nan_feature, actions)
    inf_feature = VLAFeature(
        feature.prefix_B_T_D.clone().fill_(float("inf")), feature.mask_B_T, feature.proprio_B_P
    )
    with pytest.raises(NonFiniteLossError):
        slot.train_step(inf_feature, actions)
    assert slot.step == 1
    assert_same_tensors(params, params_of(slot))
    assert_same_tensors(opt, opt_state_of(slot))
    assert torch.equal(rng, slot.generator.get_state())
    assert all(p.grad is None for p in slot.module.parameters())


def test_exception_in_head_leaves_slot_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    slot = TenantSlot("t", config("flow"), OptimizerConfig(lr=1e-2), D)
    feature, actions = make_feature(), make_actions()
    slot.train_step(feature, actions)
    params, opt, rng = params_of(slot), opt_state_of(slot), slot.generator.get_state()
    real_loss = slot.module.stacked_loss  # what a training step runs (vla.batched)

    def exploding_loss(*args: Any, **kw: Any) -> torch.Tensor:
        real_loss(*args, **kw).sum().backward()  # the step drew its RNG; stacked grads
        # and the slot's own grads (and more RNG) are written before failing
        slot.module.loss(feature, actions, generator=slot.generator).backward()
        raise RuntimeError("boom")

    monkeypatch.setattr(slot.module, "stacked_loss", exploding_loss)
    with pytest.raises(RuntimeError, match="boom"):
        slot.train_step(feature, actions)
    monkeypatch.undo()
    assert_same_tensors(params, params_of(slot))
    assert_same_tensors(opt, opt_state_of(slot))
    assert torch.equal(rng, slot.generator.get_state())
    twin = TenantSlot("t", config("flow"), OptimizerConfig(lr=1e-2), D)
    twin.train_step(feature, actions)
    assert slot.train_step(feature, actions) == twin.train_step(feature, actions)


def test_slot_manager_evicts_lru_under_budget_and_restores_bit_exactly() -> None:
    head, optim = config("oft"), OptimizerConfig(lr=3e-3)
    one = TenantSlot("probe", head, optim, D).nbytes
    store: dict[str, bytes] = {}
    mgr = SlotManager(budget_bytes=2 * one + one // 2, store=store)
    twin = TenantSlot("a", head, optim, D, seed=1)  # never evicted: the reference
    feature, actions = make_feature(), make_actions()

    a = mgr.create("a", head, optim, D, seed=1)
    a.train_step(feature, actions)
    twin.train_step(feature, actions)
    mgr.create("b", head, optim, D, seed=2)
    assert mgr.resident == ["a", "b"]
    mgr.create("c", head, optim, D, seed=3)  # over budget: evicts the LRU, "a"
    assert mgr.resident == ["b", "c"] and set(store) == {"a"}
    assert mgr.resident_bytes <= mgr.budget_bytes

    a2 = mgr.get("a")  # restore "a", evicting "b"
    assert mgr.resident == ["c", "a"] and set(store) == {"b"}
    assert mgr.resident_bytes <= mgr.budget_bytes
    assert_same_tensors(params_of(a2), params_of(twin))
    assert a2.train_step(feature, actions) == twin.train_step(feature, actions)
    assert_same_tensors(params_of(a2), params_of(twin))
    assert_same_tensors(opt_state_of(a2), opt_state_of(twin))

    mgr.get("c")  # touch: "a" becomes LRU
    mgr.get("b")
    assert mgr.resident == ["c", "b"]
    with pytest.raises(SlotBudgetError):
        mgr.acquire(["a", "b", "c"])
    assert mgr.acquire(["a", "b"])[0].tenant == "a"
    assert mgr.resident == ["a", "b"]
    with pytest.raises(KeyError):
        mgr.get("nobody")
    with pytest.raises(ValueError, match="already"):
        mgr.create("a", head, optim, D)
    mgr.remove("c")
    assert "c" not in mgr


def test_slot_load_rejects_a_different_head() -> None:
    blob = TenantSlot("t", config("oft"), OptimizerConfig(), D).to_bytes()
    state = torch.load(io.BytesIO(blob), weights_only=True)
    other = TenantSlot("t", config("oft", action_dim=6), OptimizerConfig(), D)
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict(state)
