"""Proprio standardisation and action normalisation as part of the policy: a dataset's
statistics (meta/stats.json), kept in the head's buffers, saved with the slot, applied the
same in training and acting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from schemas.model import HeadConfig, OptimizerConfig
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from vla.data import STATS_PATH, DatasetError, load_dataset, read_meta
from vla.feature import VLAFeature
from vla.slot import TenantSlot

HIDDEN = 32
HEAD = HeadConfig(kind="oft", action_dim=2, chunk_len=2, proprio_dim=4)


def feature(proprio_B_P: torch.Tensor) -> VLAFeature:
    b = proprio_B_P.shape[0]
    g = torch.Generator().manual_seed(0)
    return VLAFeature(torch.randn(b, 5, HIDDEN, generator=g), torch.ones(b, 5), proprio_B_P)


def test_recorded_dataset_carries_the_statistics_of_its_frames(tmp_path: Path) -> None:
    record(REACH2D_ID, 4, tmp_path / "ds", seed=3, env_kwargs={"image_size": 32})
    stats = read_meta(tmp_path / "ds").stats
    ds = load_dataset(tmp_path / "ds")
    state, action = stats["observation.state"], stats["action"]
    assert state.count == action.count == len(ds)
    np.testing.assert_allclose(state.mean, ds.state_N_S.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.std, ds.state_N_S.std(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(action.min, ds.action_N_A.min(0), rtol=0, atol=1e-6)
    np.testing.assert_allclose(action.max, ds.action_N_A.max(0), rtol=0, atol=1e-6)


def test_bad_statistics_file_is_refused_naming_the_field(tmp_path: Path) -> None:
    record(REACH2D_ID, 2, tmp_path / "ds", seed=0, env_kwargs={"image_size": 32})
    path = tmp_path / "ds" / STATS_PATH
    stats = json.loads(path.read_text())
    stats["observation.state"]["std"] = [1.0]
    path.write_text(json.dumps(stats))
    with pytest.raises(DatasetError, match=r"observation.state.std must be 4 finite numbers"):
        read_meta(tmp_path / "ds")
    for field, value, message in (
        ("mean", [1e39, 0.0, 0.0, 0.0], r"observation.state.mean\[0\] = 1e\+39 is beyond float32"),
        ("min", [1.0, 0.0, 0.0, 5.0], r"observation.state.min\[3\] = 5 is above .*max\[3\]"),
    ):
        bad = json.loads(json.dumps(stats))
        bad["observation.state"]["std"] = [1.0] * 4
        bad["observation.state"][field] = value
        if field == "min":
            bad["observation.state"]["max"] = [2.0, 1.0, 1.0, 1.0]
        path.write_text(json.dumps(bad))
        with pytest.raises(DatasetError, match=message):
            read_meta(tmp_path / "ds")
    stats["observation.state"]["std"] = "wide"
    path.write_text(json.dumps(stats))
    with pytest.raises(DatasetError, match=r"meta/stats.json: Expected `array`"):
        read_meta(tmp_path / "ds")
    path.unlink()  # a dataset from before statistics: none, and still readable
    assert read_meta(tmp_path / "ds").stats == {}


def test_statistics_past_the_heads_float32_are_refused() -> None:
    """Kept in float32 buffers they would be inf, and every normalised value 0 or NaN."""
    head = TenantSlot("t", HEAD, OptimizerConfig(), HIDDEN, seed=0).module
    with pytest.raises(ValueError, match=r"proprio statistics must be within torch.float32"):
        head.set_proprio_stats([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1e39])
    with pytest.raises(ValueError, match=r"action statistics must be within torch.float32"):
        head.set_action_stats([-1e39, -1.0], [1.0, 1.0])
    head.set_action_stats([-3e38, -1.0], [3e38, 1.0])  # inside the range: kept, finite
    assert torch.isfinite(head.action_half_range_A).all()


def test_statistics_standardise_proprio_in_loss_and_act_and_travel_with_the_slot() -> None:
    slot = TenantSlot("t", HEAD, OptimizerConfig(), HIDDEN, seed=0)
    raw_B_P = torch.tensor([[10.0, -3.0, 0.5, 7.0], [12.0, -1.0, 0.5, 9.0]])
    mean, std = [11.0, -2.0, 0.5, 8.0], [1.0, 1.0, 0.0, 2.0]
    plain = TenantSlot("t", HEAD, OptimizerConfig(), HIDDEN, seed=0)
    slot.module.set_proprio_stats(mean, std)
    # A constant dimension (std 0) is centred, not divided by zero.
    expected_B_P = (raw_B_P - torch.tensor(mean)) / torch.tensor([1.0, 1.0, 1.0, 2.0])
    assert torch.equal(slot.module.normalise_proprio(raw_B_P), expected_B_P)
    acted = slot.act(feature(raw_B_P), deterministic=True).actions_B_C_A
    assert torch.equal(acted, plain.act(feature(expected_B_P), deterministic=True).actions_B_C_A)
    targets = torch.zeros(2, 2, 2)
    torch.manual_seed(0)
    loss = slot.module.loss(feature(raw_B_P), targets, generator=torch.Generator())
    torch.manual_seed(0)
    same = plain.module.loss(feature(expected_B_P), targets, generator=torch.Generator())
    assert torch.equal(loss, same)

    again = TenantSlot.from_bytes(slot.to_bytes())
    assert torch.equal(again.module.proprio_mean_P, torch.tensor(mean))
    assert torch.equal(again.act(feature(raw_B_P), deterministic=True).actions_B_C_A, acted)


def test_a_slot_saved_before_statistics_existed_loads_as_identity() -> None:
    slot = TenantSlot("t", HEAD, OptimizerConfig(), HIDDEN, seed=0)
    state = slot.state_dict()
    del state["module"]["proprio_mean_P"], state["module"]["proprio_std_P"]
    other = TenantSlot("t", HEAD, OptimizerConfig(), HIDDEN, seed=1)
    other.module.set_proprio_stats([1.0] * 4, [2.0] * 4)
    other.load_state_dict(state)
    raw = torch.randn(3, 4)
    assert torch.equal(other.module.normalise_proprio(raw), raw)


def test_bad_statistics_are_refused() -> None:
    module = TenantSlot("t", HEAD, OptimizerConfig(), HIDDEN).module
    with pytest.raises(ValueError, match="3 means and 4 stds for proprio_dim 4"):
        module.set_proprio_stats([0.0] * 3, [1.0] * 4)
    with pytest.raises(ValueError, match="finite"):
        module.set_proprio_stats([0.0, float("nan"), 0.0, 0.0], [1.0] * 4)
    blind = TenantSlot("t", HeadConfig(kind="oft", action_dim=2), OptimizerConfig(), HIDDEN)
    with pytest.raises(ValueError, match="reads no proprio"):
        blind.module.set_proprio_stats([0.0], [1.0])


@pytest.mark.parametrize("kind", ["oft", "discrete", "flow"])
def test_action_range_maps_onto_minus_one_one_in_loss_log_prob_and_act(kind: str) -> None:
    """A head with an action range learns and samples ``(a - centre) / half_range`` and
    returns env units: the same as an identity head fed normalised targets."""
    head = HeadConfig(kind=kind, action_dim=3, chunk_len=2, proprio_dim=4, value_head=True)
    low, high = [0.0, -4.0, 0.3], [2.0, 0.0, 0.3]  # the last dim is constant: centred only
    centre, half = torch.tensor([1.0, -2.0, 0.3]), torch.tensor([1.0, 2.0, 1.0])
    scaled = TenantSlot("t", head, OptimizerConfig(), HIDDEN, seed=0)
    plain = TenantSlot("t", head, OptimizerConfig(), HIDDEN, seed=0)
    scaled.module.set_action_stats(low, high)
    f = feature(torch.randn(2, 4, generator=torch.Generator().manual_seed(1)))
    env_B_C_A = torch.tensor([[[0.5, -3.0, 0.3], [2.0, 0.0, 0.3]]] * 2)
    normalised_B_C_A = (env_B_C_A - centre) / half
    assert torch.equal(scaled.module.normalise_actions(env_B_C_A), normalised_B_C_A)
    torch.testing.assert_close(scaled.module.denormalise_actions(normalised_B_C_A), env_B_C_A)

    loss = scaled.module.loss(f, env_B_C_A, generator=torch.Generator().manual_seed(2))
    same = plain.module.loss(f, normalised_B_C_A, generator=torch.Generator().manual_seed(2))
    assert torch.equal(loss, same)

    out = scaled.module.act(f, generator=torch.Generator().manual_seed(3))
    ref = plain.module.act(f, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out.actions_B_C_A, ref.actions_B_C_A * half + centre)
    assert torch.equal(out.log_prob_B, ref.log_prob_B)
    # What act reports is what log_prob gives for the env-unit actions it returned.
    torch.testing.assert_close(scaled.module.log_prob(f, out.actions_B_C_A), out.log_prob_B)

    again = TenantSlot.from_bytes(scaled.to_bytes())
    assert torch.equal(again.module.action_centre_A, centre)
    assert torch.equal(again.module.action_half_range_A, half)
    state = scaled.state_dict()
    del state["module"]["action_centre_A"], state["module"]["action_half_range_A"]
    old = TenantSlot("t", head, OptimizerConfig(), HIDDEN, seed=1)
    old.load_state_dict(state)  # saved before action statistics existed: identity
    assert torch.equal(old.module.normalise_actions(env_B_C_A), env_B_C_A)
    with pytest.raises(ValueError, match="2 minima and 3 maxima for action_dim 3"):
        scaled.module.set_action_stats(low[:2], high)
    with pytest.raises(ValueError, match="max >= min"):
        scaled.module.set_action_stats(high, low)
