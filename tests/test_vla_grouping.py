"""Group batching on the real tiny backbone: grouped == alone (bit for bit where this
machine's kernels give a sample the same bits alone as in a batch, else up to float32
rounding: :mod:`tests.numerics`), and tenants stay isolated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from schemas.model import HeadConfig, OptimizerConfig
from tests.numerics import assert_same, assert_same_results, assert_same_state
from vla.backbone import Backbone
from vla.feature import ModelInputs, VLAFeature
from vla.grouping import (
    ActRequest,
    TrainRequest,
    encode_group,
    group_act,
    group_train_step,
    serial_act,
    serial_train_step,
)
from vla.normalize import Normaliser
from vla.slot import NonFiniteLossError, StepResult, TenantSlot

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
STEPS = 5
INSTRUCTIONS = ["pick up the red block", "open the drawer", "push the cube to the left"]


@dataclass(frozen=True)
class Tenant:
    name: str
    head: HeadConfig
    local_batch: int


# Different head kinds, action dims, chunk lengths and proprio dims on one backbone.
TENANTS = [
    Tenant("oft", HeadConfig(kind="oft", action_dim=7, chunk_len=4, proprio_dim=7), 2),
    Tenant("disc", HeadConfig(kind="discrete", action_dim=3, chunk_len=2, num_bins=16), 1),
    Tenant("flow", HeadConfig(kind="flow", action_dim=14, chunk_len=4, proprio_dim=14), 3),
    Tenant(
        "oftv",
        HeadConfig(kind="oft", action_dim=2, chunk_len=1, proprio_dim=3, value_head=True),
        2,
    ),
]
OPTIM = OptimizerConfig(lr=3e-3, weight_decay=0.01, warmup_steps=2, total_steps=10)


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


def make_inputs(norm: Normaliser, batch: int, proprio_dim: int, seed: int) -> ModelInputs:
    rng = np.random.default_rng(seed)
    size = norm.key.image_size
    images = rng.integers(0, 256, (batch, norm.num_views, size, size, 3), dtype=np.uint8)
    instructions = [INSTRUCTIONS[(seed + i) % len(INSTRUCTIONS)] for i in range(batch)]
    proprio = rng.standard_normal((batch, proprio_dim)).astype(np.float32)
    return norm.normalise_arrays(images, instructions, proprio)


def make_batches(norm: Normaliser, t: Tenant, seed: int) -> list[tuple[ModelInputs, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        s = seed * 100 + step
        g = torch.Generator().manual_seed(s)
        actions = torch.rand(t.local_batch, t.head.chunk_len, t.head.action_dim, generator=g)
        out.append((make_inputs(norm, t.local_batch, t.head.proprio_dim, s), actions * 2 - 1))
    return out


def new_slot(backbone: Backbone, t: Tenant, seed: int) -> TenantSlot:
    return TenantSlot(t.name, t.head, OPTIM, backbone.hidden_size, seed=seed)


def snapshot(slot: TenantSlot) -> dict[str, Any]:
    """Params, optimizer state, RNG and counters, as clones."""
    sd = slot.state_dict()
    return {
        "module": {k: v.clone() for k, v in sd["module"].items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items()} for i, s in sd["optimizer"]["state"].items()
        },
        "rng": sd["rng"].clone(),
        "step": sd["step"],
    }


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_bitwise_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def train_alone(
    backbone: Backbone, t: Tenant, seed: int, batches: list[tuple[ModelInputs, torch.Tensor]]
) -> tuple[list[StepResult | Exception], TenantSlot]:
    """The reference: the tenant alone, one backbone forward of its own per step."""
    slot = new_slot(backbone, t, seed)
    results = []
    for inputs, actions in batches:
        r = serial_train_step(backbone, [TrainRequest(t.name, slot, inputs, actions)])
        results.append(r[t.name])
    return results, slot


class CountingBackbone:
    """The real backbone, recording the batch size of every forward it runs."""

    def __init__(self, inner: Backbone) -> None:
        self.inner = inner
        self.calls: list[int] = []

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        self.calls.append(inputs.batch_size)
        return self.inner.encode(inputs)


# -- equivalence -----------------------------------------------------------------------------


def test_every_head_kind_trains_bitwise_identically_alone_and_grouped(
    backbone: Backbone, normaliser: Normaliser
) -> None:
    """Each of oft/discrete/flow/oft+value, grouped with the three others for 5 steps, takes
    exactly the losses and reaches exactly the parameters it does alone (deterministic
    algorithms, CPU: bitwise where the machine allows it)."""
    batches = {t.name: make_batches(normaliser, t, seed=i) for i, t in enumerate(TENANTS)}
    alone = {t.name: train_alone(backbone, t, i, batches[t.name]) for i, t in enumerate(TENANTS)}

    slots = {t.name: new_slot(backbone, t, i) for i, t in enumerate(TENANTS)}
    counting = CountingBackbone(backbone)
    grouped: dict[str, list[StepResult | Exception]] = {t.name: [] for t in TENANTS}
    for step in range(STEPS):
        requests = [TrainRequest(t.name, slots[t.name], *batches[t.name][step]) for t in TENANTS]
        for name, r in group_train_step(counting, requests).items():
            grouped[name].append(r)
    # One forward per step over all tenants' samples.
    assert counting.calls == [sum(t.local_batch for t in TENANTS)] * STEPS

    for t in TENANTS:
        solo_results, solo_slot = alone[t.name]
        assert all(isinstance(r, StepResult) for r in solo_results), solo_results
        assert_same_results(grouped[t.name], solo_results, t.name)
        assert_same_state(snapshot(slots[t.name]), snapshot(solo_slot), t.name)
    losses = [r.loss for r in grouped["flow"] if isinstance(r, StepResult)]
    assert len(set(losses)) == STEPS  # the steps really moved


def test_group_act_matches_serial_act(backbone: Backbone, normaliser: Normaliser) -> None:
    def run(fn: Any) -> dict[str, Any]:
        reqs = [
            ActRequest(
                t.name,
                new_slot(backbone, t, i),
                make_inputs(normaliser, t.local_batch, t.head.proprio_dim, seed=i),
                deterministic=(i == 0),
            )
            for i, t in enumerate(TENANTS)
        ]
        return fn(backbone, reqs)

    grouped, serial = run(group_act), run(serial_act)
    for t in TENANTS:
        g, s = grouped[t.name], serial[t.name]
        assert g.actions_B_C_A.shape == (t.local_batch, t.head.chunk_len, t.head.action_dim)
        assert_same(g.actions_B_C_A, s.actions_B_C_A, t.name)
        assert_same(g.log_prob_B, s.log_prob_B, t.name)
        assert (g.value_B is None) == (not t.head.value_head)
        if g.value_B is not None:
            assert s.value_B is not None
            assert_same(g.value_B, s.value_B, t.name)


def test_encode_group_partitions_with_each_tenants_own_proprio(
    backbone: Backbone, normaliser: Normaliser
) -> None:
    parts = [make_inputs(normaliser, b, p, seed=b) for b, p in [(1, 7), (3, 0), (2, 14)]]
    features = encode_group(backbone, parts)
    for part, feature in zip(parts, features, strict=True):
        alone = backbone.encode(part)
        assert_same(feature.prefix_B_T_D, alone.prefix_B_T_D)
        assert torch.equal(feature.mask_B_T, alone.mask_B_T)
        assert torch.equal(feature.proprio_B_P, part.proprio_B_P)


# -- isolation -------------------------------------------------------------------------------


def run_focus_with(
    backbone: Backbone,
    normaliser: Normaliser,
    spoil: Any,
) -> tuple[list[StepResult | Exception], TenantSlot, dict[str, list[StepResult | Exception]]]:
    """Train TENANTS[2] ("flow") grouped with the others for STEPS steps, letting ``spoil``
    rewrite the other tenants' requests each step; return the focus tenant's results and
    slot, and all results."""
    batches = {t.name: make_batches(normaliser, t, seed=i) for i, t in enumerate(TENANTS)}
    slots = {t.name: new_slot(backbone, t, i) for i, t in enumerate(TENANTS)}
    results: dict[str, list[StepResult | Exception]] = {t.name: [] for t in TENANTS}
    for step in range(STEPS):
        requests = [TrainRequest(t.name, slots[t.name], *batches[t.name][step]) for t in TENANTS]
        requests = [r if r.tenant == "flow" else spoil(r, step) for r in requests]
        for name, r in group_train_step(backbone, requests).items():
            results[name].append(r)
    return results["flow"], slots["flow"], results


@pytest.fixture(scope="module")
def focus_alone(
    backbone: Backbone, normaliser: Normaliser
) -> tuple[list[StepResult | Exception], dict[str, Any]]:
    batches = make_batches(normaliser, TENANTS[2], seed=2)
    results, slot = train_alone(backbone, TENANTS[2], 2, batches)
    return results, snapshot(slot)


def test_other_tenants_nan_data_does_not_touch_this_tenant(
    backbone: Backbone, normaliser: Normaliser, focus_alone: Any
) -> None:
    def nan_data(r: TrainRequest, step: int) -> TrainRequest:
        if r.tenant == "oftv":  # NaN targets: rejected as bad input
            return TrainRequest(
                r.tenant, r.slot, r.inputs, torch.full_like(r.actions_B_C_A, np.nan)
            )
        # NaN images: the shared forward carries NaN in these tenants' rows only
        tensors = dict(r.inputs.tensors)
        tensors["pixel_values"] = torch.full_like(tensors["pixel_values"], float("nan"))
        inputs = ModelInputs(r.inputs.key, tensors, r.inputs.proprio_B_P)
        return TrainRequest(r.tenant, r.slot, inputs, r.actions_B_C_A)

    focus, slot, results = run_focus_with(backbone, normaliser, nan_data)
    assert_same_results(focus, focus_alone[0])
    assert_same_state(snapshot(slot), focus_alone[1])
    for name in ("oft", "disc"):
        assert all(isinstance(r, NonFiniteLossError) for r in results[name]), results[name]
    assert all(isinstance(r, ValueError) and "NaN" in str(r) for r in results["oftv"])


def test_other_tenants_head_exception_does_not_touch_this_tenant(
    backbone: Backbone, normaliser: Normaliser, focus_alone: Any
) -> None:
    def explode(*args: Any, **kw: Any) -> torch.Tensor:
        raise RuntimeError("bug in a tenant's head")

    def break_head(r: TrainRequest, step: int) -> TrainRequest:
        if r.tenant == "oft":
            r.slot.module.stacked_loss = explode  # type: ignore[method-assign]
        if r.tenant == "disc":  # and a mis-shaped target for another one
            return TrainRequest(r.tenant, r.slot, r.inputs, r.actions_B_C_A[:, :1])
        return r

    focus, slot, results = run_focus_with(backbone, normaliser, break_head)
    assert_same_results(focus, focus_alone[0])
    assert_same_state(snapshot(slot), focus_alone[1])
    assert all(isinstance(r, RuntimeError) for r in results["oft"])
    assert all(isinstance(r, ValueError) and "(1, 2, 3)" in str(r) for r in results["disc"])
    assert all(isinstance(r, StepResult) for r in results["oftv"])


def test_malformed_inputs_fail_only_their_tenant(
    backbone: Backbone, normaliser: Normaliser, focus_alone: Any
) -> None:
    """A tenant whose tensors do not match its key breaks the concatenation; the group falls
    back to one forward per tenant and only that tenant fails."""

    def wrong_size(r: TrainRequest, step: int) -> TrainRequest:
        if r.tenant != "disc":
            return r
        tensors = dict(r.inputs.tensors)
        tensors["pixel_values"] = tensors["pixel_values"][..., :32, :32]
        return TrainRequest(
            r.tenant,
            r.slot,
            ModelInputs(r.inputs.key, tensors, r.inputs.proprio_B_P),
            r.actions_B_C_A,
        )

    focus, slot, results = run_focus_with(backbone, normaliser, wrong_size)
    # The fallback runs the focus tenant's forward alone: exactly the reference.
    assert focus == focus_alone[0]
    assert_bitwise_equal(snapshot(slot), focus_alone[1])
    assert all(isinstance(r, Exception) for r in results["disc"])
    assert all(isinstance(r, StepResult) for r in results["oft"] + results["oftv"])


def test_incompatible_keys_form_separate_groups(backbone: Backbone, normaliser: Normaliser) -> None:
    two_views = Normaliser(backbone, num_views=2, token_budget=16)
    longer_text = Normaliser(backbone, num_views=1, token_budget=24)
    norms = [normaliser, two_views, normaliser, longer_text]
    assert len({n.key for n in norms}) == 3

    def requests() -> list[TrainRequest]:
        reqs = []
        for i, (t, norm) in enumerate(zip(TENANTS, norms, strict=True)):
            g = torch.Generator().manual_seed(i)
            actions = torch.rand(t.local_batch, t.head.chunk_len, t.head.action_dim, generator=g)
            inputs = make_inputs(norm, t.local_batch, t.head.proprio_dim, seed=i)
            reqs.append(TrainRequest(t.name, new_slot(backbone, t, i), inputs, actions))
        return reqs

    counting = CountingBackbone(backbone)
    grouped = group_train_step(counting, requests())
    # Tenants 0 and 2 share a key (2 + 3 samples); 1 and 3 are alone in theirs.
    assert counting.calls == [2 + 3, 1, 2]
    serial = serial_train_step(backbone, requests())
    assert grouped.keys() == serial.keys()
    for name in grouped:
        assert_same_results([grouped[name]], [serial[name]], name)
    assert all(isinstance(r, StepResult) for r in grouped.values())


def test_duplicate_tenant_in_one_call_is_rejected(
    backbone: Backbone, normaliser: Normaliser
) -> None:
    t = TENANTS[0]
    slot = new_slot(backbone, t, 0)
    inputs, actions = make_batches(normaliser, t, seed=0)[0]
    req = TrainRequest(t.name, slot, inputs, actions)
    with pytest.raises(ValueError, match="twice"):
        group_train_step(backbone, [req, req])


# -- proportions -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["oft", "discrete", "flow"])
def test_default_head_training_costs_under_a_tenth_of_the_backbone_forward(
    backbone: Backbone, normaliser: Normaliser, kind: str
) -> None:
    """DESIGN §3 proportions, counted in FLOPs on the tiny backbone's shortest prefix (one
    view, 16 text tokens) with the default head size (hidden 64, one layer, chunk 1)."""
    head = HeadConfig(kind=kind, action_dim=7, proprio_dim=7)  # type: ignore[arg-type]
    slot = TenantSlot("t", head, OptimizerConfig(), backbone.hidden_size)
    B = 4
    inputs = make_inputs(normaliser, B, 7, seed=0)
    with FlopCounterMode(display=False) as backbone_flops:
        feature = backbone.encode(inputs)
    with FlopCounterMode(display=False) as head_flops:
        slot.train_step(feature, torch.rand(B, 1, 7) * 2 - 1)
    ratio = head_flops.get_total_flops() / backbone_flops.get_total_flops()
    assert ratio < 0.1, f"{kind} head step costs {ratio:.3f} of the backbone forward"


# -- benchmark entry point -------------------------------------------------------------------


def test_bench_main_runs_as_a_subprocess_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "bench.grouping", "--backbone", "tiny", "--tenants", "1,2"]
    cmd += ["--local-batch", "1", "--repeats", "1", "--warmup", "0", "--threads", "1"]
    cmd += ["--json", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, env=env, cwd=REPO, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "stage forward" in proc.stdout and "stage train_step" in proc.stdout
    result = json.loads(out.read_text())
    assert (result["backbone"], result["threads"]) == ("tiny", 1)
    cells = {(c["tenants"], c["local_batch"], c["stage"]): c for c in result["cells"]}
    assert set(cells) == {(n, 1, s) for n in (1, 2) for s in ("forward", "train_step")}
    for c in cells.values():
        assert c["serial_ms"] > 0 and c["grouped_ms"] > 0 and c["speedup"] > 0
    for n in (1, 2):  # a train cell also says how much of the grouped step the heads took
        train = cells[(n, 1, "train_step")]
        assert 0 < train["grouped_heads_ms"] < train["grouped_ms"]
