"""Group-batching benchmark: one grouped backbone forward vs one forward per tenant.

For every (tenants, local batch) cell and stage:

* ``forward`` — *serial*: one ``backbone.encode`` per tenant on its already-normalised inputs;
  *grouped*: :func:`vla.grouping.encode_group` (concatenation, one forward, partition by tenant).
* ``train_step`` — the same forwards plus, per tenant, head loss, backward and AdamW step
  (:func:`vla.grouping.serial_train_step` vs :func:`vla.grouping.group_train_step`). Tenants
  cycle through the oft / discrete / flow heads with different action and proprio dims.

Serial and grouped runs are interleaved (serial, grouped, serial, grouped, ...) after warm-up,
so slow drift of a shared machine hits both alike; each cell reports the median times and
the median of the per-pair speedups. Normalisation (image decode/resize, tokenisation) is
outside the timed region: both sides need it equally. On CUDA the backbone runs in bfloat16
and timings synchronise the device.

The grouped side splits its forward where the backbone's cost table (:mod:`vla.costmodel`,
measured before the sweep or read with ``--cost-table FILE``) says smaller forwards are faster,
as the trainer and inferencer do; ``--no-split`` times one forward per group however large.
Each grouped cell records ``forwards``, the forwards its group ran in.

``python -m bench.grouping --backbone tiny`` (also ``joynexus bench grouping``) prints the tables
shaped like the paper's group-batching figure: rows = tenants, columns = local batch.
:func:`sweep` runs the same cells on a backbone already built (``bench/gpu_grouping.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from schemas.model import HeadConfig, OptimizerConfig
from vla import costmodel
from vla.backbone import Backbone
from vla.feature import ModelInputs, VLAFeature
from vla.grouping import (
    FeatureEncoder,
    Phase,
    TrainRequest,
    encode_group,
    group_train_step,
    serial_train_step,
)
from vla.normalize import Normaliser
from vla.slot import StepResult, TenantSlot, lr_at

STAGES = ("forward", "train_step")
#: Repeats per cell that keep the default sweep (4 x 4 cells, both stages) well under five
#: minutes on two shared CPU cores; other backbones (real checkpoints) get the fallback.
DEFAULT_REPEATS = {"tiny": 9, "tiny-224": 5}
FALLBACK_REPEATS = 3
#: The cost table's measurement may take longer here than at a service's start-up: on a
#: loaded machine a short budget ends it at a few samples and caps every group there.
COST_TABLE_BUDGET_S = 20.0
_INSTRUCTIONS = ("pick up the red block", "open the top drawer", "push the cube to the left")
#: Tenant i's head: kinds and action schemas cycle, so a group mixes them like a real service.
_HEADS = (
    HeadConfig(kind="oft", action_dim=7, chunk_len=4, proprio_dim=7),
    HeadConfig(kind="discrete", action_dim=3, chunk_len=4, proprio_dim=0),
    HeadConfig(kind="flow", action_dim=14, chunk_len=4, proprio_dim=14),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _inputs(norm: Normaliser, batch: int, proprio_dim: int, seed: int) -> ModelInputs:
    rng = np.random.default_rng(seed)
    size = norm.key.image_size
    images = rng.integers(0, 256, (batch, norm.num_views, size, size, 3), dtype=np.uint8)
    instructions = [_INSTRUCTIONS[(seed + i) % len(_INSTRUCTIONS)] for i in range(batch)]
    proprio = rng.standard_normal((batch, proprio_dim)).astype(np.float32)
    return norm.normalise_arrays(images, instructions, proprio)


def _requests(
    bb: Backbone, norm: Normaliser, num_tenants: int, local_batch: int
) -> list[TrainRequest]:
    reqs = []
    for i in range(num_tenants):
        head = _HEADS[i % len(_HEADS)]
        slot = TenantSlot(
            f"t{i}", head, OptimizerConfig(lr=1e-3), bb.hidden_size, seed=i, device=bb.device
        )
        g = torch.Generator().manual_seed(i)
        actions = torch.rand(local_batch, head.chunk_len, head.action_dim, generator=g) * 2 - 1
        inputs = _inputs(norm, local_batch, head.proprio_dim, seed=1000 * num_tenants + i)
        reqs.append(TrainRequest(slot.tenant, slot, inputs, actions.to(bb.device)))
    return reqs


def _check(results: dict[str, StepResult | Exception]) -> None:
    """A benchmark that timed failed steps would be meaningless: fail loudly instead."""
    for tenant, r in results.items():
        if isinstance(r, Exception):
            raise RuntimeError(f"benchmark step failed for tenant {tenant}: {r!r}") from r


def _plain_step(slot: TenantSlot, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> None:
    """A tenant's step as it ran before batched heads: the head module's own loss and
    backward, ``clip_grad_norm_`` and the tenant's own ``AdamW.step`` (timing reference)."""
    slot.module.train()
    slot.optimizer.zero_grad(set_to_none=True)
    loss = slot.module.loss(feature, actions_B_C_A, generator=slot.generator)
    if not math.isfinite(float(loss.detach())):
        raise RuntimeError(f"benchmark step failed for tenant {slot.tenant}: loss {loss}")
    loss.backward()
    clip = slot.optim_config.grad_clip if slot.optim_config.grad_clip > 0 else math.inf
    torch.nn.utils.clip_grad_norm_(slot.module.parameters(), clip)
    for group in slot.optimizer.param_groups:
        group["lr"] = lr_at(slot.optim_config, slot.step)
    slot.optimizer.step()
    slot.optimizer.zero_grad(set_to_none=True)
    slot.step += 1


def _plain_serial(bb: Backbone, reqs: Sequence[TrainRequest]) -> None:
    """One forward and one :func:`_plain_step` per tenant: the serial train step as it was
    timed before batched heads and the shared optimizer step."""
    for r in reqs:
        _plain_step(r.slot, bb.encode(r.inputs), r.actions_B_C_A)


def _cell_fns(
    bb: Backbone,
    norm: Normaliser,
    stage: str,
    num_tenants: int,
    local_batch: int,
    grouped_encoder: FeatureEncoder | None = None,
    timeline: list[Phase] | None = None,
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(serial, grouped) callables for one cell. Train cells get separate slot sets so each
    side does the same work on its own optimizer state. ``grouped_encoder``: what the grouped
    side encodes with (default the backbone; a :class:`vla.costmodel.SplitEncoder` splits).
    ``timeline``: the grouped train step's phases are appended to it."""
    enc: FeatureEncoder = bb if grouped_encoder is None else grouped_encoder
    if stage == "forward":
        parts = [r.inputs for r in _requests(bb, norm, num_tenants, local_batch)]

        def serial_fwd() -> object:
            return [bb.encode(p) for p in parts]

        def grouped_fwd() -> object:
            return encode_group(enc, parts)

        return serial_fwd, grouped_fwd
    if stage == "train_step":
        serial_reqs = _requests(bb, norm, num_tenants, local_batch)
        grouped_reqs = _requests(bb, norm, num_tenants, local_batch)
        return (
            lambda: _check(serial_train_step(bb, serial_reqs)),
            lambda: _check(group_train_step(enc, grouped_reqs, timeline=timeline)),
        )
    raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")


def run_grouping_bench(
    backbone: str,
    tenants: Sequence[int],
    local_batches: Sequence[int],
    stages: Sequence[str] = STAGES,
    repeats: int = 5,
    warmup: int = 1,
    threads: int = 2,
    num_views: int = 1,
    token_budget: int = 16,
    split: bool = True,
    cost_table: str = costmodel.MEASURE,
) -> dict[str, Any]:
    """Time serial vs grouped backbone work for every (tenants, local batch, stage) cell.

    ``backbone``: a checkpoint directory or a tiny name (``tiny``, ``tiny-224``). ``repeats``
    interleaved serial/grouped pairs are timed per cell after ``warmup`` untimed pairs.
    ``threads``: torch intra-op threads. ``split``: the grouped side splits its forward by
    the cost table (``cost_table``: ``measure`` or a file, see
    :func:`vla.costmodel.table_for`). Returns ``{"backbone", "device", "threads", "cells":
    [{"tenants", "local_batch", "stage", "serial_ms", "grouped_ms", "speedup", "forwards"}],
    "split", "cost_table", ...}`` with median milliseconds; ``speedup`` is the median over the
    interleaved pairs of ``serial / grouped`` (robust to load drift on a shared machine; close
    to, not exactly, the ratio of the two medians).
    """
    _validate(tenants, local_batches, stages, repeats, warmup, threads)
    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    bb = Backbone.load(
        backbone, dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu"
    )
    return sweep(
        bb,
        backbone,
        tenants,
        local_batches,
        stages=stages,
        repeats=repeats,
        warmup=warmup,
        num_views=num_views,
        token_budget=token_budget,
        split=split,
        cost_table=cost_table,
    )


def _validate(
    tenants: Sequence[int],
    local_batches: Sequence[int],
    stages: Sequence[str],
    repeats: int,
    warmup: int,
    threads: int,
) -> None:
    for name, v in (("repeats", repeats), ("threads", threads)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not tenants or not local_batches or min(*tenants, *local_batches) < 1:
        raise ValueError(f"tenants and local batches must be >= 1: {tenants}, {local_batches}")
    for stage in stages:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")


def sweep(
    bb: Backbone,
    name: str,
    tenants: Sequence[int],
    local_batches: Sequence[int],
    stages: Sequence[str] = STAGES,
    repeats: int = 5,
    warmup: int = 1,
    num_views: int = 1,
    token_budget: int = 16,
    split: bool = True,
    cost_table: str = costmodel.MEASURE,
) -> dict[str, Any]:
    """The cells of :func:`run_grouping_bench` on an already built backbone ``bb`` (reported
    as ``name``), at the current torch thread count."""
    _validate(tenants, local_batches, stages, repeats, warmup, torch.get_num_threads())
    # uint8 views, as the trainer sends them: every timed forward normalises its own samples
    norm = Normaliser(bb, num_views=num_views, token_budget=token_budget, uint8_pixels=True)
    device = torch.device(bb.device)
    cuda = device.type == "cuda"
    table = None
    if split:
        largest = max(tenants) * max(local_batches)
        table = costmodel.table_for(
            bb, cost_table, max_samples=max(2, largest), budget_s=COST_TABLE_BUDGET_S
        )
    cells = []
    for stage in stages:
        for n in tenants:
            for b in local_batches:
                encoder = None if table is None else costmodel.SplitEncoder(bb, table)
                timeline: list[Phase] = []
                serial_fn, grouped_fn = _cell_fns(bb, norm, stage, n, b, encoder, timeline)
                plain_fn = None
                if stage == "train_step":
                    plain_reqs = _requests(bb, norm, n, b)
                    plain_fn = functools.partial(_plain_serial, bb, plain_reqs)
                serial_ms: list[float] = []
                grouped_ms: list[float] = []
                plain_ms: list[float] = []
                heads_ms: list[float] = []
                for i in range(warmup + repeats):
                    s = _time_ms(serial_fn, device)
                    timeline.clear()
                    g = _time_ms(grouped_fn, device)
                    p = _time_ms(plain_fn, device) if plain_fn is not None else math.nan
                    if i >= warmup:
                        serial_ms.append(s)
                        grouped_ms.append(g)
                        plain_ms.append(p)
                        heads_ms.extend(
                            (ph.end_ns - ph.start_ns) / 1e6
                            for ph in timeline
                            if ph.name == "heads and optimizer"
                        )
                ratios = [s / g for s, g in zip(serial_ms, grouped_ms, strict=True)]
                extra: dict[str, float] = {}
                if plain_fn is not None:
                    # Serial steps now run each tenant as a stack of one (vla.batched); the
                    # plain per-tenant path they replaced is the fairer baseline to quote too.
                    plain_ratios = [p / g for p, g in zip(plain_ms, grouped_ms, strict=True)]
                    extra = {
                        "plain_serial_ms": round(statistics.median(plain_ms), 3),
                        "speedup_vs_plain": round(statistics.median(plain_ratios), 3),
                        # Where the grouped step goes: its heads' forward and backward and
                        # the shared clip + AdamW (the rest is the backbone forward).
                        "grouped_heads_ms": round(statistics.median(heads_ms), 3),
                    }
                cells.append(
                    {
                        **extra,
                        "tenants": n,
                        "local_batch": b,
                        "stage": stage,
                        "serial_ms": round(statistics.median(serial_ms), 3),
                        "grouped_ms": round(statistics.median(grouped_ms), 3),
                        "speedup": round(statistics.median(ratios), 3),
                        "forwards": (
                            1 if table is None else len(table.chunks(n * b, norm.seq_len))
                        ),
                    }
                )
    return {
        "backbone": name,
        "backbone_id": bb.backbone_id,
        "num_params": bb.num_params,
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.machine()})",
        "dtype": str(bb.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "warmup": warmup,
        "num_views": num_views,
        "token_budget": token_budget,
        "prefix_tokens": norm.seq_len,
        "torch": torch.__version__,
        "split": table is not None,
        "cost_table": None if table is None else table.to_json(),
        "cells": cells,
    }


def format_table(result: dict[str, Any]) -> str:
    """One table per stage: rows = tenants, columns = local batch, cells = speedup with the
    median serial and grouped ms, like the paper's group-batching figure."""
    lines = [
        f"group batching: backbone {result['backbone']} on {result['device']}, "
        f"{result['threads']} threads, median of {result.get('repeats', '?')} interleaved runs"
        + (", grouped forwards split by the cost table" if result.get("split") else "")
    ]
    stages = list(dict.fromkeys(c["stage"] for c in result["cells"]))
    for stage in stages:
        cells = [c for c in result["cells"] if c["stage"] == stage]
        tenants = sorted({c["tenants"] for c in cells})
        batches = sorted({c["local_batch"] for c in cells})
        by_key = {(c["tenants"], c["local_batch"]): c for c in cells}
        texts = {
            k: f"{c['speedup']:.2f}x ({c['serial_ms']:.1f}/{c['grouped_ms']:.1f})"
            + (f" {c['speedup_vs_plain']:.2f}x plain" if "speedup_vs_plain" in c else "")
            for k, c in by_key.items()
        }
        width = max(len("local batch 8"), *(len(t) for t in texts.values()))
        lines.append("")
        plain = any("speedup_vs_plain" in c for c in cells)
        lines.append(
            f"stage {stage}: speedup (serial ms / grouped ms)"
            + (", then vs the plain per-tenant step" if plain else "")
        )
        header = "tenants | " + " | ".join(f"local batch {b}".rjust(width) for b in batches)
        lines.append(header)
        lines.append("-" * len(header))
        for n in tenants:
            row = [texts.get((n, b), "-").rjust(width) for b in batches]
            lines.append(f"{n:>7} | " + " | ".join(row))
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (``1,2,4,8``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """``joynexus bench grouping``: run the sweep, print the tables, optionally write JSON."""
    p = argparse.ArgumentParser(
        prog="joynexus bench grouping",
        description="Grouped vs per-tenant backbone forwards (and train steps).",
    )
    p.add_argument("--backbone", default="tiny", help="checkpoint DIR, tiny or tiny-224")
    p.add_argument("--tenants", type=int_list, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    p.add_argument("--local-batch", type=int_list, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"timed pairs per cell (default {DEFAULT_REPEATS}, else {FALLBACK_REPEATS})",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed pairs per cell")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--views", type=int, default=1, help="camera views per sample")
    p.add_argument("--token-budget", type=int, default=16, help="text tokens per sample")
    p.add_argument(
        "--split",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split grouped forwards by the backbone's cost table (as the services do)",
    )
    p.add_argument(
        "--cost-table",
        default=costmodel.MEASURE,
        help="'measure' (before the sweep) or a JSON file (read; written if missing)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = p.parse_args(argv)
    repeats = args.repeats or DEFAULT_REPEATS.get(args.backbone, FALLBACK_REPEATS)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    result = run_grouping_bench(
        args.backbone,
        args.tenants,
        args.local_batch,
        stages=stages,
        repeats=repeats,
        warmup=args.warmup,
        threads=args.threads,
        num_views=args.views,
        token_budget=args.token_budget,
        split=args.split,
        cost_table=args.cost_table,
    )
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
