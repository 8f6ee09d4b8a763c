"""A cost-aware group size: what one grouped backbone forward costs, and how to split a group
so that no forward is slower than running its parts apart.

Grouping amortises a forward's fixed cost, but past some size a forward gets more expensive
per sample (on a CPU, ``tiny-224`` costs 4.6 ms/sample at 32 samples and 15.6 at 64: the
activations fall out of cache), and one big group is then slower than serial. A
:class:`CostTable` holds the measured time of one forward at a ladder of sizes for one
(backbone, device, dtype, threads); :meth:`CostTable.split` partitions a compatible group of
requests into consecutive sub-groups with the least total modelled time (a small dynamic
program), so a sub-group is formed only where the table says it pays, and
:meth:`CostTable.chunks` does the same for the samples of one forward.

Sizes are counted in samples of the shape the table was measured at (``tokens_per_sample``
prefix tokens); a batch of another shape (more views, a longer token budget) is scaled by its
prefix length, which tracks how the vision tower and decoder work grows. Between measured
sizes the time is interpolated linearly; no group of several requests is formed past the
largest measured size (nothing is known there).

Tables come from :func:`measure` (a few bounded forwards at start-up, cached per process),
from a file written by :meth:`CostTable.save`, or from a ``joynexus bench grouping --json``
result (:func:`load`). :func:`table_for` is what services call. :class:`SplitEncoder` wraps a
backbone so that any caller of ``encode`` (the trainer's grouped step) gets its forward split
by the table; per-sample features are the same either way (the forward is per sample).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from vla.feature import ModelInputs, VLAFeature

log = logging.getLogger(__name__)

#: File format marker of a saved table.
KIND = "joynexus.cost_table"
#: ``table_for`` sources that are not files.
MEASURE, OFF = "measure", "off"
#: Defaults of one start-up measurement: sizes up to 64 samples, best of 3 timed forwards
#: each, and at most 3 s in all (tiny: ~0.6 s; tiny-224 stops at its knee, ~2.5 s).
DEFAULT_MAX_SAMPLES = 64
DEFAULT_REPEATS = 3
DEFAULT_BUDGET_S = 3.0
#: A group (or a larger forward) must be modelled this much faster than the alternative to
#: be chosen: on a shared machine the knee moves with load (``tiny-224``'s 32-sample forward
#: measured 3.4x an 8-sample one at start-up and 4.2-4.7x minutes later).
GROUP_MARGIN = 0.2
#: Stop measuring larger sizes once one costs this many times the best per-sample time:
#: past the knee, larger forwards only get worse (and each takes longer to time).
KNEE_RATIO = 1.5


class Encoder(Protocol):
    """What a table is measured on and a :class:`SplitEncoder` wraps (a ``vla.backbone``
    ``Backbone`` is one)."""

    backbone_id: str
    device: torch.device
    dtype: torch.dtype
    num_params: int
    image_size: int

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        """One frozen forward over the whole batch."""
        ...


@dataclass(frozen=True)
class CostTable:
    """Measured time of one grouped forward by size, for one backbone on one device.

    ``points``: ``(samples, ms)`` pairs, sizes strictly increasing from 1. ``tokens_per_sample``:
    prefix tokens of the samples timed (sizes of other shapes are scaled by it).
    """

    backbone_id: str
    device: str
    dtype: str
    threads: int
    tokens_per_sample: int
    points: tuple[tuple[int, float], ...]
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        sizes = [n for n, _ in self.points]
        if not sizes or sizes[0] != 1:
            raise ValueError(f"cost table needs a point at 1 sample, got sizes {sizes}")
        if any(b <= a for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"cost table sizes must increase strictly, got {sizes}")
        if any(not ms > 0 for _, ms in self.points):
            raise ValueError(f"cost table times must be > 0 ms, got {list(self.points)}")
        if self.tokens_per_sample < 1:
            raise ValueError(f"tokens_per_sample must be >= 1, got {self.tokens_per_sample}")

    @property
    def max_samples(self) -> int:
        """The largest size measured: no group of several requests goes past it."""
        return self.points[-1][0]

    def forward_ms(self, samples: float) -> float:
        """Modelled time of one forward over ``samples`` (of the measured shape): linear
        between measured sizes; past the largest, its per-sample time (a lone request that
        big runs anyway; the model only has to rank it)."""
        points = self.points
        if samples <= points[0][0]:  # below one sample of the measured shape: its fixed cost
            return points[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(points):
            if samples <= n1:
                return t0 + (t1 - t0) * (samples - n0) / (n1 - n0)
        n, t = points[-1]
        return t * samples / n

    def per_sample_ms(self, samples: float) -> float:
        return self.forward_ms(samples) / samples

    def units(self, samples: int, tokens_per_sample: int | None = None) -> float:
        """``samples`` of ``tokens_per_sample`` prefix tokens in samples of the table's shape."""
        if tokens_per_sample is None:
            return float(samples)
        return samples * tokens_per_sample / self.tokens_per_sample

    def split(
        self,
        sizes: Sequence[int],
        tokens_per_sample: int | None = None,
        margin: float | None = None,
    ) -> list[list[int]]:
        """Partition items of ``sizes`` samples (one compatible group, in order) into
        consecutive sub-groups of least total modelled time; returns their indices.

        A sub-group of several items counts ``1 + margin`` times its modelled time
        (:data:`GROUP_MARGIN` by default): it is formed only where the table says it beats
        its parts by that much, the table's uncertainty. So every sub-group of two or more
        items fits :attr:`max_samples` and is, by the table, faster than any split of it into
        consecutive parts by the margin; the whole is never slower than one forward per item.
        Ties keep the larger group (fewer forwards).
        """
        factor = 1.0 + (GROUP_MARGIN if margin is None else margin)
        if any(s < 1 for s in sizes):
            raise ValueError(f"group sizes must be >= 1, got {list(sizes)}")
        k = len(sizes)
        limit = self.max_samples + 1e-9
        units = [self.units(s, tokens_per_sample) for s in sizes]
        best = [0.0] + [float("inf")] * k
        cut = [0] * (k + 1)
        for j in range(1, k + 1):
            total = 0.0
            for i in range(j - 1, -1, -1):  # group i..j-1, growing leftwards
                total += units[i]
                if i < j - 1 and total > limit:
                    break
                cost = best[i] + self.forward_ms(total) * (factor if i < j - 1 else 1.0)
                # <= : at equal cost the group reaching further left (fewer forwards) wins.
                if cost <= best[j] * (1 + 1e-12):
                    best[j], cut[j] = cost, i
        groups: list[list[int]] = []
        j = k
        while j > 0:
            groups.append(list(range(cut[j], j)))
            j = cut[j]
        return groups[::-1]

    def chunks(
        self, samples: int, tokens_per_sample: int | None = None, margin: float | None = None
    ) -> list[int]:
        """Sizes of the forwards that ``samples`` samples of one batch run in: the least-time
        partition by the table, except that the smallest largest-forward whose partition
        is within ``margin`` (:data:`GROUP_MARGIN`) of the least time wins (larger forwards
        are where the table is least sure: the knee moves with the machine's load). Each is
        at most :attr:`max_samples` unless one sample alone is larger."""
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        unit = self.units(1, tokens_per_sample)
        return list(_chunks(self, samples, unit, GROUP_MARGIN if margin is None else margin))

    # -- files ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "backbone_id": self.backbone_id,
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads,
            "tokens_per_sample": self.tokens_per_sample,
            "points": [[n, round(ms, 4)] for n, ms in self.points],
        }

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        tmp.replace(path)


@lru_cache(maxsize=4096)
def _chunks(table: CostTable, samples: int, unit: float, margin: float) -> tuple[int, ...]:
    """Partition of ``samples`` equal samples (``unit`` table samples each): see
    :meth:`CostTable.chunks`."""
    most = max(1, int((table.max_samples + 1e-9) // unit))

    def plan(cap: int) -> tuple[float, list[int]]:
        best = [0.0] + [float("inf")] * samples
        take = [0] * (samples + 1)
        for m in range(1, samples + 1):
            for c in range(min(m, cap), 0, -1):  # larger chunks first: they win ties
                cost = best[m - c] + table.forward_ms(c * unit)
                if cost < best[m] * (1 - 1e-12):
                    best[m], take[m] = cost, c
        sizes: list[int] = []
        m = samples
        while m > 0:
            sizes.append(take[m])
            m -= take[m]
        return best[samples], sorted(sizes, reverse=True)

    least, sizes = plan(most)
    caps = sorted({max(1, min(most, int(n // unit))) for n, _ in table.points} | {most})
    for cap in caps:
        if cap >= max(sizes):
            break
        cost, smaller = plan(cap)
        if cost <= least * (1 + margin):
            return tuple(smaller)
    return tuple(sizes)


def from_json(doc: dict[str, Any], source: str = "") -> CostTable:
    """A table from a saved table or from a ``joynexus bench grouping --json`` result (its
    ``forward`` cells: ``serial_ms / tenants`` is one forward of ``local_batch`` samples,
    ``grouped_ms`` one forward of ``tenants * local_batch``; the best time per size)."""
    where = f" in {source}" if source else ""
    try:
        if doc.get("kind") == KIND:
            points = [(int(n), float(ms)) for n, ms in doc["points"]]
            return CostTable(
                str(doc["backbone_id"]),
                str(doc["device"]),
                str(doc["dtype"]),
                int(doc["threads"]),
                int(doc["tokens_per_sample"]),
                tuple(points),
                source,
            )
        if "cells" in doc:
            times: dict[int, float] = {}
            for c in doc["cells"]:
                if c["stage"] != "forward":
                    continue
                n, b = int(c["tenants"]), int(c["local_batch"])
                for size, ms in ((b, c["serial_ms"] / n), (n * b, c["grouped_ms"])):
                    times[size] = min(float(ms), times.get(size, float("inf")))
            if 1 not in times:
                raise ValueError("the benchmark has no forward cell with local batch 1")
            return CostTable(
                str(doc["backbone_id"]),
                "cuda" if "cpu" not in str(doc["device"]) else "cpu",
                str(doc["dtype"]),
                int(doc["threads"]),
                int(doc["prefix_tokens"]),
                tuple(sorted(times.items())),
                source,
            )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed cost table{where}: missing or bad field {exc}") from exc
    raise ValueError(
        f"not a cost table{where}: expected kind {KIND!r} or a 'bench grouping' result"
    )


def load(path: str | Path, backbone: Encoder | None = None) -> CostTable:
    """Read a table (or a benchmark result) from ``path``; with ``backbone``, refuse one
    measured on another backbone or device type, naming both."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read cost table {str(path)!r}: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"cost table {str(path)!r} is not a JSON object")
    table = from_json(doc, str(path))
    if backbone is not None:
        _check_matches(table, backbone)
    return table


def _check_matches(table: CostTable, backbone: Encoder) -> None:
    where = f"cost table {table.source!r}" if table.source else "cost table"
    if table.backbone_id != backbone.backbone_id:
        raise ValueError(
            f"{where} is for backbone {table.backbone_id!r}, this process serves "
            f"{backbone.backbone_id!r}"
        )
    if table.device.split(":")[0] != backbone.device.type:
        raise ValueError(
            f"{where} was measured on {table.device}, this backbone is on {backbone.device}"
        )


# -- measuring -------------------------------------------------------------------------------
def ladder(max_samples: int) -> list[int]:
    """Sizes timed up to ``max_samples`` (which is always one): 1, 2, 4, 8, then each power
    of two and 1.5 times it (12, 16, 24, 32, 48, 64, ...)."""
    sizes = {1, 2, 4}
    p = 8
    while p <= max_samples:
        sizes.update((p, p + p // 2))
        p *= 2
    return sorted({n for n in sizes if n < max_samples} | {max_samples})


def _sample_inputs(backbone: Encoder, samples: int, num_views: int, token_budget: int) -> Any:
    from vla.normalize import Normaliser  # the backbone's own normaliser; lazy: heavy imports

    # uint8 views, as the trainer and inferencer send them: the timed forward normalises them
    norm = Normaliser(
        backbone,  # type: ignore[arg-type]
        num_views=num_views,
        token_budget=token_budget,
        uint8_pixels=True,
    )
    rng = np.random.default_rng(0)
    size = backbone.image_size
    images = rng.integers(0, 256, (samples, num_views, size, size, 3), dtype=np.uint8)
    instructions = ["pick up the red block and put it in the bowl"] * samples
    return norm.normalise_arrays(images, instructions, np.zeros((samples, 0), np.float32))


def _head(inputs: ModelInputs, n: int) -> ModelInputs:
    return ModelInputs(
        inputs.key, {k: v[:n] for k, v in inputs.tensors.items()}, inputs.proprio_B_P[:n]
    )


def measure(
    backbone: Encoder,
    *,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    repeats: int = DEFAULT_REPEATS,
    budget_s: float = DEFAULT_BUDGET_S,
    num_views: int = 1,
    token_budget: int = 16,
) -> CostTable:
    """Time one forward at each size of :func:`ladder` (``max_samples``) and keep the best
    of ``repeats`` (at least 2) per size (the least disturbed by other work on a shared
    machine). The first pass warms each size up, times it twice and grows the sizes; it stops
    past the knee (:data:`KNEE_RATIO`, confirmed by two more timings) or before a size whose
    timings would overrun ``budget_s`` (sizes 1 and 2 are always timed), and the table ends
    at the last size timed. Further passes time every size again in turn, so a burst of load
    hits all sizes alike, not one."""
    if max_samples < 1 or repeats < 1 or budget_s <= 0:
        raise ValueError(
            f"measure needs max_samples >= 1, repeats >= 1, budget_s > 0; got {max_samples}, "
            f"{repeats}, {budget_s}"
        )
    inputs = _sample_inputs(backbone, max_samples, num_views, token_budget)
    cuda = backbone.device.type == "cuda"

    def time_ms(part: ModelInputs) -> float:
        if cuda:
            torch.cuda.synchronize(backbone.device)
        t0 = time.perf_counter()
        backbone.encode(part)
        if cuda:
            torch.cuda.synchronize(backbone.device)
        return (time.perf_counter() - t0) * 1e3

    t_start = time.perf_counter()
    best: dict[int, float] = {}
    best_per_sample = float("inf")
    for n in ladder(max_samples):
        if len(best) >= 2:  # would this size's timings overrun the budget? (time ~ size)
            last_n = max(best)
            projected_s = (max(repeats, 2) + 1) * best[last_n] / 1e3 * n / last_n
            if time.perf_counter() - t_start + projected_s > budget_s:
                break
        part = _head(inputs, n)
        time_ms(part)  # warm-up
        best[n] = min(time_ms(part), time_ms(part))
        if best[n] / n > KNEE_RATIO * best_per_sample:
            # Confirm before stopping: a burst of other work is not a knee.
            best[n] = min(best[n], time_ms(part), time_ms(part))
            if best[n] / n > KNEE_RATIO * best_per_sample:
                break
        best_per_sample = min(best_per_sample, best[n] / n)
    for _ in range(repeats - 2):
        for n in best:
            best[n] = min(best[n], time_ms(_head(inputs, n)))
    points = sorted(best.items())
    table = CostTable(
        backbone.backbone_id,
        str(backbone.device),
        str(backbone.dtype).removeprefix("torch."),
        torch.get_num_threads(),
        int(inputs.tensors["input_ids"].shape[1]),
        tuple(points),
        "measured",
    )
    log.info(
        "cost table for %s: %s (%.2f s)",
        backbone.backbone_id,
        ", ".join(f"{n}: {ms / n:.2f} ms/sample" for n, ms in points),
        time.perf_counter() - t_start,
    )
    return table


_cache: dict[tuple[str, int, str, str, int, int], CostTable] = {}
_cache_lock = threading.Lock()


def table_for(
    backbone: Encoder,
    source: str = MEASURE,
    *,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    budget_s: float = DEFAULT_BUDGET_S,
) -> CostTable | None:
    """The table a service splits its groups by. ``source``: ``"off"`` (None: never split),
    ``"measure"`` (measured once per process per backbone, device, dtype and thread count),
    or a JSON file: read if it exists (a saved table or a benchmark result), else measured
    and written there for the next start. Blocking (forwards): call it where the model is
    loaded."""
    if source == OFF:
        return None
    if source != MEASURE and Path(source).exists():
        return load(source, backbone)
    key = (
        backbone.backbone_id,
        backbone.num_params,
        str(backbone.device),
        str(backbone.dtype),
        torch.get_num_threads(),
        max_samples,
    )
    with _cache_lock:
        table = _cache.get(key)
        if table is None:
            table = measure(backbone, max_samples=max_samples, budget_s=budget_s)
            _cache[key] = table
    if source != MEASURE:
        table.save(source)
    return table


# -- a splitting encoder ---------------------------------------------------------------------
class SplitEncoder:
    """A backbone whose ``encode`` runs a batch in the forwards :meth:`CostTable.chunks`
    picks and concatenates the features back (the caller sees one batch). Pass it wherever
    a feature encoder is taken (``vla.grouping.group_train_step``)."""

    def __init__(self, backbone: Encoder, table: CostTable) -> None:
        _check_matches(table, backbone)
        self.backbone = backbone
        self.table = table
        self.forwards = 0

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        """Features of ``inputs``: one forward, or several where the table says that is
        faster (rows in order; each row's feature is its own forward's)."""
        n = inputs.batch_size
        sizes = self.table.chunks(n, int(inputs.tensors["input_ids"].shape[1]))
        self.forwards += len(sizes)
        if len(sizes) == 1:
            return self.backbone.encode(inputs)
        parts: list[VLAFeature] = []
        start = 0
        for size in sizes:
            part = ModelInputs(
                inputs.key,
                {k: v[start : start + size] for k, v in inputs.tensors.items()},
                inputs.proprio_B_P[start : start + size],
            )
            parts.append(self.backbone.encode(part))
            start += size
        return VLAFeature(
            torch.cat([f.prefix_B_T_D for f in parts]),
            torch.cat([f.mask_B_T for f in parts]),
            torch.cat([f.proprio_B_P for f in parts]),
        )
