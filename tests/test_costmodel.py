"""The cost-aware group size (vla.costmodel): splits are the least-time consecutive partition
by the table (checked against brute force), never slower per sample than their parts, never
past the measured sizes; the splitting encoder gives the same features as one forward; tables
are measured within their bound, read from files and benchmark results, and refused for
another backbone; a grouped train step through the splitting encoder is the unsplit one."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.model import HeadConfig, OptimizerConfig
from tests.numerics import assert_same, assert_same_results, assert_same_state
from vla import costmodel
from vla.backbone import Backbone
from vla.costmodel import CostTable, SplitEncoder
from vla.feature import PIXELS_U8, ModelInputs
from vla.grouping import TrainRequest, group_train_step
from vla.normalize import Normaliser
from vla.slot import TenantSlot

#: tiny-224 as measured on this machine (README): per-sample cost falls to ~4.6 ms at 24-32
#: samples, then a 48-sample forward costs 9.7 ms/sample.
TINY_224 = CostTable(
    "tiny-224",
    "cpu",
    "float32",
    2,
    69,
    (
        (1, 12.1),
        (2, 17.0),
        (4, 26.5),
        (8, 44.5),
        (12, 58.8),
        (16, 80.0),
        (24, 111.9),
        (32, 146.9),
        (48, 464.9),
    ),
)


def partitions(k: int) -> Iterator[list[list[int]]]:
    """Every partition of range(k) into consecutive groups."""
    for cuts in itertools.product((False, True), repeat=max(0, k - 1)):
        groups, current = [], [0]
        for i, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(current)
                current = []
            current.append(i)
        groups.append(current)
        yield groups


def cost(table: CostTable, sizes: list[int], groups: list[list[int]]) -> float:
    return sum(table.forward_ms(sum(sizes[i] for i in g)) for g in groups)


def allowed(table: CostTable, sizes: list[int], groups: list[list[int]]) -> bool:
    return all(len(g) == 1 or sum(sizes[i] for i in g) <= table.max_samples for g in groups)


def check_split(table: CostTable, sizes: list[int]) -> list[list[int]]:
    """The exact optimum (no margin) against brute force."""
    groups = table.split(sizes, margin=0.0)
    assert [i for g in groups for i in g] == list(range(len(sizes))), "each item once, in order"
    assert allowed(table, sizes, groups), "no group of several items past the measured sizes"
    total = cost(table, sizes, groups)
    best = min(cost(table, sizes, p) for p in partitions(len(sizes)) if allowed(table, sizes, p))
    assert total <= best * (1 + 1e-9), f"{groups} costs {total}, the best partition {best}"
    serial = sum(table.forward_ms(s) for s in sizes)
    assert total <= serial * (1 + 1e-9), "never slower than one forward per item"
    for g in groups:
        n = sum(sizes[i] for i in g)
        # Not slower than its members run apart, nor than any split of it in two.
        assert table.forward_ms(n) <= sum(table.forward_ms(sizes[i]) for i in g) * (1 + 1e-9)
        for cut in range(1, len(g)):
            a = sum(sizes[i] for i in g[:cut])
            assert table.forward_ms(n) <= (table.forward_ms(a) + table.forward_ms(n - a)) * (
                1 + 1e-9
            )
    return groups


@st.composite
def tables(draw: st.DrawFn) -> CostTable:
    sizes = sorted(draw(st.sets(st.integers(2, 40), min_size=1, max_size=6)) | {1})
    times = draw(st.lists(st.floats(0.5, 50.0), min_size=len(sizes), max_size=len(sizes)))
    # Time per forward: a fixed cost plus per-sample costs that may rise (a knee) or fall.
    points = tuple((n, t * n**0.5 + 3.0) for n, t in zip(sizes, times, strict=True))
    return CostTable("bb", "cpu", "float32", 1, 10, points)


@settings(max_examples=150, deadline=None)
@given(table=tables(), sizes=st.lists(st.integers(1, 24), min_size=1, max_size=8))
def test_split_is_the_least_time_consecutive_partition_and_never_slower_than_its_parts(
    table: CostTable, sizes: list[int]
) -> None:
    check_split(table, sizes)


@settings(max_examples=100, deadline=None)
@given(table=tables(), sizes=st.lists(st.integers(1, 24), min_size=1, max_size=8))
def test_with_the_margin_a_group_forms_only_where_it_beats_its_parts_by_the_margin(
    table: CostTable, sizes: list[int]
) -> None:
    groups = table.split(sizes)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    assert allowed(table, sizes, groups)
    factor = 1 + costmodel.GROUP_MARGIN
    for g in (g for g in groups if len(g) > 1):
        n = sum(sizes[i] for i in g)
        assert table.forward_ms(n) * factor <= sum(table.forward_ms(sizes[i]) for i in g) * (
            1 + 1e-9
        )
    serial = sum(table.forward_ms(s) for s in sizes)
    assert cost(table, sizes, groups) <= serial * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(table=tables(), samples=st.integers(1, 80))
def test_chunks_take_the_smallest_forwards_within_the_margin_of_the_least_time(
    table: CostTable, samples: int
) -> None:
    least = table.chunks(samples, margin=0.0)
    chosen = table.chunks(samples)
    assert sum(least) == sum(chosen) == samples
    assert max(chosen) <= max(max(least), table.max_samples)
    assert max(chosen) <= max(least)
    t_least = sum(table.forward_ms(c) for c in least)
    t_chosen = sum(table.forward_ms(c) for c in chosen)
    assert t_chosen <= t_least * (1 + costmodel.GROUP_MARGIN) + 1e-9
    assert t_least <= table.forward_ms(samples) * (1 + 1e-9) or samples > table.max_samples


def test_the_measured_tiny_224_table_keeps_groups_under_its_knee() -> None:
    # 8 tenants x 8 samples: one forward of 64 would cost ~15 ms/sample; two of 32 do not.
    groups = check_split(TINY_224, [8] * 8)
    assert [len(g) for g in groups] == [4, 4]
    # Below the knee the whole group stays one forward.
    assert check_split(TINY_224, [1] * 8) == [list(range(8))]
    assert check_split(TINY_224, [4] * 8) == [list(range(8))]
    # A lone request larger than anything measured still runs (alone).
    assert check_split(TINY_224, [60, 1, 1]) == [[0], [1, 2]]


def test_sizes_of_another_shape_are_scaled_by_their_prefix_length() -> None:
    # Twice the tokens per sample: 8 x 4 samples weigh like 64 of the measured shape.
    assert TINY_224.split([4] * 8) == [list(range(8))]
    groups = TINY_224.split([4] * 8, tokens_per_sample=2 * TINY_224.tokens_per_sample)
    assert len(groups) > 1
    assert all(sum(4 * 2 for _ in g) <= TINY_224.max_samples for g in groups)


@pytest.mark.parametrize("samples", [1, 7, 32, 33, 64, 240])
def test_chunks_cover_the_batch_within_the_measured_sizes_at_least_time(samples: int) -> None:
    sizes = TINY_224.chunks(samples, margin=0.0)
    assert sum(sizes) == samples and max(sizes) <= TINY_224.max_samples
    total = sum(TINY_224.forward_ms(s) for s in sizes)
    assert total <= TINY_224.forward_ms(samples) * (1 + 1e-9)
    assert total <= samples * TINY_224.forward_ms(1) * (1 + 1e-9)
    if samples <= 32:
        assert sizes == [samples], "below the knee a batch is one forward"


def test_bad_tables_and_sizes_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="point at 1 sample"):
        CostTable("bb", "cpu", "float32", 1, 10, ((2, 1.0),))
    with pytest.raises(ValueError, match="increase strictly"):
        CostTable("bb", "cpu", "float32", 1, 10, ((1, 1.0), (4, 2.0), (4, 3.0)))
    with pytest.raises(ValueError, match="> 0 ms"):
        CostTable("bb", "cpu", "float32", 1, 10, ((1, 0.0),))
    with pytest.raises(ValueError, match="group sizes must be >= 1"):
        TINY_224.split([2, 0])


# -- real backbone -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> Backbone:
    torch.set_num_threads(1)
    return Backbone.load("tiny")


def test_split_encoder_gives_the_features_of_one_forward(tiny: Backbone) -> None:
    table = CostTable("tiny", "cpu", "float32", 1, 36, ((1, 5.0), (2, 6.0), (3, 60.0)))
    encoder = SplitEncoder(tiny, table)
    norm = Normaliser(tiny, 1, 16)
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (7, 1, 64, 64, 3), dtype=np.uint8)
    proprio = rng.standard_normal((7, 5)).astype(np.float32)
    inputs = norm.normalise_arrays(images, ["push the cube"] * 7, proprio)
    assert table.chunks(7, norm.seq_len) == [2, 2, 2, 1]
    whole = tiny.encode(inputs)
    split = encoder.encode(inputs)
    assert encoder.forwards == 4
    # Each sample's forward is its own: the same features (bitwise where the machine allows).
    assert_same(split.prefix_B_T_D, whole.prefix_B_T_D)
    assert torch.equal(split.mask_B_T, whole.mask_B_T)
    assert torch.equal(split.proprio_B_P, whole.proprio_B_P)


def test_measure_is_bounded_and_gives_a_table_the_backbone_accepts(tiny: Backbone) -> None:
    table = costmodel.measure(tiny, max_samples=8, repeats=1)
    assert [n for n, _ in table.points] == costmodel.ladder(8) == [1, 2, 4, 8]
    assert (
        table.backbone_id == "tiny" and table.tokens_per_sample == Normaliser(tiny, 1, 16).seq_len
    )
    # A budget too small for anything past two sizes stops there (the bound, not a timing).
    short = costmodel.measure(tiny, max_samples=64, repeats=1, budget_s=1e-6)
    assert [n for n, _ in short.points] == [1, 2]
    check_split(table, [1, 2, 1, 3, 1])


def test_measure_times_the_forward_on_uint8_views_as_the_roles_send_them(
    tiny: Backbone, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trainer and inferencer send uint8 views and the forward normalises them, so a table
    # timed on float pixel_values would leave that work out of every size's cost.
    timed: list[frozenset[str]] = []
    encode = tiny.encode

    def recording_encode(inputs: ModelInputs) -> object:
        timed.append(frozenset(inputs.tensors))
        return encode(inputs)

    monkeypatch.setattr(tiny, "encode", recording_encode)
    costmodel.measure(tiny, max_samples=2, repeats=1)
    assert timed and all(PIXELS_U8 in names and "pixel_values" not in names for names in timed)


def test_table_for_measures_once_per_process_writes_the_file_and_reads_it_back(
    tiny: Backbone, tmp_path: Path
) -> None:
    assert costmodel.table_for(tiny, "off") is None
    first = costmodel.table_for(tiny, max_samples=4)
    assert first is not None
    assert costmodel.table_for(tiny, max_samples=4) is first, "cached per process"
    path = tmp_path / "costs.json"
    written = costmodel.table_for(tiny, str(path), max_samples=4)
    assert path.exists() and written is first
    read = costmodel.table_for(tiny, str(path))
    assert read is not None and read.points == tuple((n, round(ms, 4)) for n, ms in first.points)
    assert read.source == str(path)


def test_a_benchmark_result_is_a_table_and_another_backbones_table_is_refused(
    tiny: Backbone, tmp_path: Path
) -> None:
    bench = {
        "backbone": "tiny-224",
        "backbone_id": "tiny-224",
        "device": "cpu (x86_64)",
        "dtype": "float32",
        "threads": 2,
        "prefix_tokens": 69,
        "cells": [
            {"tenants": 2, "local_batch": 1, "stage": "forward", "serial_ms": 24.0,
             "grouped_ms": 17.0, "speedup": 1.4},
            {"tenants": 8, "local_batch": 8, "stage": "forward", "serial_ms": 360.0,
             "grouped_ms": 995.8, "speedup": 0.36},
            {"tenants": 8, "local_batch": 4, "stage": "forward", "serial_ms": 212.0,
             "grouped_ms": 146.9, "speedup": 1.44},
            {"tenants": 2, "local_batch": 8, "stage": "train_step", "serial_ms": 1.0,
             "grouped_ms": 1.0, "speedup": 1.0},
        ],
    }  # fmt: skip
    path = tmp_path / "grouping.json"
    path.write_text(json.dumps(bench))
    table = costmodel.load(path)
    assert table.points == ((1, 12.0), (2, 17.0), (4, 26.5), (8, 45.0), (32, 146.9), (64, 995.8))
    assert table.device == "cpu" and table.tokens_per_sample == 69
    assert table.split([8] * 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"is for backbone 'tiny-224', this process serves 'tiny'"):
        costmodel.load(path, tiny)
    with pytest.raises(ValueError, match="is for backbone"):
        costmodel.table_for(tiny, str(path))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": costmodel.KIND, "backbone_id": "tiny"}))
    with pytest.raises(ValueError, match=r"malformed cost table .*bad\.json.*missing or bad field"):
        costmodel.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a JSON object"):
        costmodel.load(bad)


def test_a_grouped_train_step_through_the_split_encoder_equals_the_unsplit_one(
    tiny: Backbone,
) -> None:
    heads = [
        HeadConfig(kind="oft", action_dim=7, chunk_len=4, proprio_dim=7),
        HeadConfig(kind="discrete", action_dim=3, chunk_len=4, proprio_dim=0),
        HeadConfig(kind="flow", action_dim=5, chunk_len=4, proprio_dim=3),
    ]
    norm = Normaliser(tiny, 1, 16)

    def requests() -> list[TrainRequest]:
        out = []
        for i, head in enumerate(heads * 2):
            rng = np.random.default_rng(i)
            b = 1 + i % 3
            images = rng.integers(0, 256, (b, 1, 64, 64, 3), dtype=np.uint8)
            proprio = rng.standard_normal((b, head.proprio_dim)).astype(np.float32)
            inputs = norm.normalise_arrays(images, ["open the drawer"] * b, proprio)
            actions = torch.from_numpy(rng.uniform(-1, 1, (b, 4, head.action_dim))).float()
            slot = TenantSlot(f"t{i}", head, OptimizerConfig(lr=1e-3), tiny.hidden_size, seed=i)
            out.append(TrainRequest(slot.tenant, slot, inputs, actions))
        return out

    # 12 samples in forwards of at most 2: the table's knee is at 3.
    table = CostTable("tiny", "cpu", "float32", 1, norm.seq_len, ((1, 5.0), (2, 6.0), (3, 60.0)))
    encoder = SplitEncoder(tiny, table)
    whole, split = requests(), requests()
    for _ in range(3):
        a = group_train_step(tiny, whole)
        b = group_train_step(encoder, split)
        for r in whole:
            ra, rb = a[r.tenant], b[r.tenant]
            assert not isinstance(ra, Exception) and not isinstance(rb, Exception), (ra, rb)
            assert_same_results([rb], [ra], r.tenant)
    assert encoder.forwards == 3 * 6
    for rw, rs in zip(whole, split, strict=True):
        assert_same_state(
            {"module": rs.slot.module.state_dict()},
            {"module": rw.slot.module.state_dict()},
            rw.tenant,
        )
