"""``joynexus bench sft``: N tenants' SFT jobs sharing one trainer vs the same jobs run one
after another on it, through the real bus (embedded NATS, master, env worker, trainer).

Reports samples/s for both, their ratio, and the bus overhead per step: the fraction of the
trainer's wall time spent outside forward/backward/optimizer (fetching, decoding,
normalising, committing checkpoints, publishing events, acking), from the trainer's own
gauges in its heartbeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bus.codec import decode
from bus.connect import connect
from bus.datasets import register_path
from bus.identity import OPERATOR_NAME
from bus.kv import kv_values
from bus.local import StackInfo
from clients.sdk import Client
from schemas import subjects
from schemas.health import HEARTBEAT_DECODER
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID, REACH_GRASP_ID
from services.launcher import LocalStack, backbone_of

HEADS: list[dict[str, Any]] = [
    {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4},
    {"kind": "discrete", "action_dim": 3, "chunk_len": 1, "proprio_dim": 4},
    {"kind": "flow", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4},
    {"kind": "oft", "action_dim": 3, "chunk_len": 2, "proprio_dim": 0},
]


def job_specs(
    prefix: str,
    tenants: int,
    steps: int,
    batch: int,
    data: dict[int, Path],
    backbone: str,
    token_budget: int,
    epochs: int | None = None,
) -> list[dict[str, Any]]:
    """``steps`` optimizer steps per job, or ``epochs`` passes over its dataset if given."""
    specs = []
    for i in range(tenants):
        head = HEADS[i % len(HEADS)]
        specs.append(
            {
                "kind": "sft",
                "tenant": f"{prefix}-{i}",
                "backbone": backbone,
                "dataset": data[head["action_dim"]].name,  # an id in the tenant's namespace
                "head": head,
                **({"epochs": epochs} if epochs else {"steps": steps}),
                "batch_size": batch,
                "seed": i,
                "checkpoint_every": 10,
                "token_budget": token_budget,
            }
        )
    return specs


async def trainer_gauges(info: StackInfo) -> dict[str, float]:
    nc = await connect(
        info.url, creds=info.creds(OPERATOR_NAME), user=info.user, password=info.password
    )
    try:
        for value in (await kv_values(nc.jetstream(), subjects.KV_HEARTBEATS, "trainer.")).values():
            return dict(decode(HEARTBEAT_DECODER, value).gauges)
    finally:
        await nc.close()
    raise RuntimeError("no trainer heartbeat")


async def run_jobs(
    info: StackInfo, specs: list[dict[str, Any]], concurrent: bool, data: dict[int, Path]
) -> float:
    """Wall seconds from the first submit to the last job's success (each tenant's dataset
    is registered in its namespace first, as the operator does, outside the timing)."""
    # the operator acts for the bench's tenants (no TenantRecord: the master takes any)
    async with await Client.connect(
        info.url, creds=info.creds(OPERATOR_NAME), user=info.user, password=info.password
    ) as client:
        for spec in specs:
            path = data[spec["head"]["action_dim"]]
            await register_path(client.js, spec["tenant"], spec["dataset"], path)
        t0 = time.perf_counter()
        if concurrent:
            jobs = [await client.train_sft(s) for s in specs]
            await asyncio.gather(*(j.wait(3600) for j in jobs))
        else:
            for s in specs:
                await (await client.train_sft(s)).wait(3600)
        return time.perf_counter() - t0


async def measure(
    info: StackInfo,
    specs: list[dict[str, Any]],
    concurrent: bool,
    data: dict[int, Path],
) -> dict[str, float]:
    await asyncio.sleep(1.5)  # let the previous run's last heartbeat gauges land
    before = await trainer_gauges(info)
    wall = await run_jobs(info, specs, concurrent, data)
    await asyncio.sleep(1.5)
    after = await trainer_gauges(info)
    compute = after["compute_s"] - before["compute_s"]
    rounds = after["round_s"] - before["round_s"]
    samples = after["samples"] - before["samples"]
    hits = after.get("feature_cache_hits", 0.0) - before.get("feature_cache_hits", 0.0)
    misses = after.get("feature_cache_misses", 0.0) - before.get("feature_cache_misses", 0.0)
    return {
        "wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "compute_s": compute,
        "bus_overhead_fraction": 1.0 - compute / wall,
        "round_overhead_fraction": 1.0 - compute / rounds if rounds > 0 else float("nan"),
    }


def run_stack(
    args: argparse.Namespace,
    home: Path,
    data: dict[int, Path],
    cache_mb: float,
    sequential: bool,
    backbone_service: bool = False,
) -> tuple[dict[str, float], dict[str, float] | None]:
    """One stack (its trainer's feature cache ``cache_mb``, 0 = off; ``backbone_service``:
    the backbone in its own role, the trainer holding only heads): the multi-tenant
    measurement, and the sequential one if asked."""
    stack = LocalStack(
        home,
        tenants=(),
        roles={"master": 1, "envs": 1, "trainer": 1},
        backbone_service=backbone_service,
        role_args={
            "trainer": [
                "--torch-threads",
                str(args.torch_threads),
                "--feature-cache-mb",
                str(cache_mb),
            ]
        },
        backbones=[backbone_of(args.backbone)],
    )
    try:
        info = stack.start(120)
        backbone_id = backbone_of(args.backbone).backbone_id

        def specs(prefix: str, tenants: int, steps: int) -> list[dict[str, Any]]:
            return job_specs(
                prefix,
                tenants,
                steps,
                args.batch_size,
                data,
                backbone_id,
                args.token_budget,
                None if prefix == "warm" else args.epochs,
            )

        # Warm-up (first-touch costs: consumers, normaliser caches, allocator).
        asyncio.run(run_jobs(info, specs("warm", 1, 5), True, data))
        multi = asyncio.run(measure(info, specs("multi", args.tenants, args.steps), True, data))
        seq = None
        if sequential:
            seq = asyncio.run(measure(info, specs("seq", args.tenants, args.steps), False, data))
        return multi, seq
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="joynexus bench sft", description=__doc__)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per job")
    p.add_argument("--epochs", type=int, help="passes over each job's dataset (not --steps)")
    p.add_argument("--batch-size", type=int, default=2, help="local batch per tenant step")
    p.add_argument("--token-budget", type=int, default=16, help="instruction tokens/sample")
    p.add_argument("--backbone", default="tiny", help="tiny name or checkpoint dir")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument(
        "--feature-cache-mb",
        type=float,
        default=256.0,
        help="the trainer's feature cache for the cached run (see --no-cache-compare)",
    )
    p.add_argument(
        "--no-cache-compare",
        action="store_true",
        help="skip the second stack whose trainer caches features (cache_speedup)",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="also run a stack with the backbone in its own role and a head-only trainer "
        "(split_ratio: its samples/s over the in-process one's)",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="joynexus-bench-sft-") as tmp:
        home = Path(tmp)
        data = {2: home / "reach", 3: home / "grasp"}
        record(REACH2D_ID, 24, data[2], seed=0)
        record(REACH_GRASP_ID, 24, data[3], seed=1)
        multi, seq = run_stack(args, home / "uncached", data, 0.0, sequential=True)
        assert seq is not None
        cached = None
        if not args.no_cache_compare:
            cached, _ = run_stack(args, home / "cached", data, args.feature_cache_mb, False)
        split = None
        if args.split:
            split, _ = run_stack(args, home / "split", data, 0.0, False, backbone_service=True)
    result: dict[str, Any] = {
        "tenants": args.tenants,
        "steps_per_job": None if args.epochs else args.steps,
        "epochs_per_job": args.epochs,
        "batch_size": args.batch_size,
        "token_budget": args.token_budget,
        "backbone": args.backbone,
        "multi_samples_per_s": multi["samples_per_s"],
        "sequential_samples_per_s": seq["samples_per_s"],
        "speedup": multi["samples_per_s"] / seq["samples_per_s"],
        "bus_overhead_fraction": multi["bus_overhead_fraction"],
        "trainer_loop_overhead_fraction": multi["round_overhead_fraction"],
        "sequential_bus_overhead_fraction": seq["bus_overhead_fraction"],
        "multi_wall_s": multi["wall_s"],
        "sequential_wall_s": seq["wall_s"],
    }
    print(f"{'mode':<16}{'wall s':>10}{'samples/s':>12}{'bus overhead':>14}{'cache hits':>12}")
    rows = [("multi", multi), ("sequential", seq)] + ([("multi, cached", cached)] if cached else [])
    rows += [("multi, split", split)] if split else []
    for name, m in rows:
        print(
            f"{name:<16}{m['wall_s']:>10.2f}{m['samples_per_s']:>12.1f}"
            f"{m['bus_overhead_fraction']:>14.1%}{m['cache_hit_rate']:>12.1%}"
        )
    print(
        f"speedup {result['speedup']:.2f}x; trainer-loop overhead (multi) "
        f"{multi['round_overhead_fraction']:.1%}"
    )
    if cached is not None:
        result["cache_speedup"] = cached["samples_per_s"] / multi["samples_per_s"]
        result["cache_hit_rate"] = cached["cache_hit_rate"]
        result["cached_multi_samples_per_s"] = cached["samples_per_s"]
        print(
            f"cache_speedup {result['cache_speedup']:.2f}x (multi-tenant, cached vs uncached), "
            f"cache_hit_rate {cached['cache_hit_rate']:.1%}"
        )
    if split is not None:
        result["split_samples_per_s"] = split["samples_per_s"]
        result["split_ratio"] = split["samples_per_s"] / multi["samples_per_s"]
        print(
            f"split_ratio {result['split_ratio']:.2f}x (backbone role + head-only trainer vs "
            "the backbone in the trainer)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
