"""``joynexus bench lowlevel``: the low-level API's ``forward_backward`` + ``optim_step`` over
the real bus (embedded NATS, master, trainer), against the same steps run in process.

For 1, 4 and 8 concurrent clients (one tenant each, one session each):

* **round trip**: each client sends ``forward_backward``, waits for it, sends ``optim_step``,
  waits: the median time of one such step, as a tenant's own algorithm that needs each loss
  before going on sees it;
* **pipelined**: each client sends all its steps at once (the futures are awaited at the end):
  steps per second over all clients, as an algorithm that does not wait sees it;
* **in process**: the same steps on slots of this process with the trainer's kernels (one
  grouped forward_backward for the N tenants, then one optim step each), steps per second.

The ratios ``pipelined / in process`` and ``round trip (as steps/s) / in process`` are the
service's cost over calling the model directly, measured in one run (absolute times on
these machines are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bus.identity import OPERATOR_NAME
from bus.local import StackInfo
from clients.lowlevel import AdamParams, ServiceClient, VLABatch
from services.launcher import LocalStack
from vla import optimsteps
from vla.backbone import Backbone
from vla.grouping import TrainRequest, group_train_step
from vla.normalize import Normaliser
from vla.slot import TenantSlot

HEAD: dict[str, Any] = {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}
TOKEN_BUDGET = 16


def make_batch(seed: int, size: int = 4) -> VLABatch:
    """A batch of random VLA samples for the tiny head (``HEAD``), reproducible by seed."""
    rng = np.random.default_rng(seed)
    return VLABatch(
        rng.integers(0, 255, (size, 1, 32, 32, 3), dtype=np.uint8),
        ["reach the red dot"] * size,
        rng.standard_normal((size, 4)).astype(np.float32),
        rng.uniform(-1, 1, (size, 4, 2)).astype(np.float32),
    )


async def _connect(info: StackInfo, tenant: str) -> ServiceClient:
    # The operator's identity in a stack with auth (the bench's tenants are not registered:
    # the master takes any in open mode); the URL alone otherwise.
    creds = info.creds(OPERATOR_NAME) if info.auth else None
    return await ServiceClient.connect(
        info.url, tenant=tenant, creds=creds, user=info.user, password=info.password
    )


async def over_bus(
    info: StackInfo, clients: int, steps: int, batch: int, prefix: str
) -> dict[str, float]:
    services = [await _connect(info, f"{prefix}-{clients}-{i}") for i in range(clients)]
    try:
        sessions = await asyncio.gather(
            *(
                s.create_training_client(head=HEAD, seed=i, token_budget=TOKEN_BUDGET)
                for i, s in enumerate(services)
            )
        )
        batches = [make_batch(i, batch) for i in range(steps)]
        params = AdamParams(1e-3, grad_clip=1.0)

        async def round_trips(training: Any) -> list[float]:
            times = []
            for b in batches:
                t0 = time.perf_counter()
                await training.forward_backward(b)
                await training.optim_step(params)
                times.append(time.perf_counter() - t0)
            return times

        per_client = await asyncio.gather(*(round_trips(t) for t in sessions))
        latencies = [x for times in per_client for x in times[1:]]  # the first warms up

        async def pipelined(training: Any) -> None:
            futures = []
            for b in batches:
                futures += [training.forward_backward(b), training.optim_step(params)]
            await asyncio.gather(*futures)

        t0 = time.perf_counter()
        await asyncio.gather(*(pipelined(t) for t in sessions))
        wall = time.perf_counter() - t0
        await asyncio.gather(*(t.close() for t in sessions))
    finally:
        for s in services:
            await s.close()
    median = statistics.median(latencies)
    return {
        "round_trip_ms": 1e3 * median,
        "round_trip_steps_per_s": clients / median,
        "pipelined_steps_per_s": clients * steps / wall,
    }


def in_process(backbone: Backbone, clients: int, steps: int, batch: int) -> float:
    """Steps per second of the same work on local slots: per step, one grouped
    forward_backward of all clients, then each one's optim step."""
    normaliser = Normaliser(backbone, 1, TOKEN_BUDGET, uint8_pixels=True)  # as the trainer's
    slots = [
        TenantSlot(f"t{i}", _head(), _optim(), backbone.hidden_size, seed=i) for i in range(clients)
    ]
    batches = [make_batch(i, batch) for i in range(steps)]
    params = [optimsteps.AdamParams(1e-3, grad_clip=1.0)] * clients

    def one(b: VLABatch) -> None:
        inputs = normaliser.normalise_arrays(b.images, list(b.instructions), b.proprio)
        actions = torch.from_numpy(b.actions)
        requests = [TrainRequest(s.tenant, s, inputs, actions, "accumulate") for s in slots]
        group_train_step(backbone, requests)
        optimsteps.optim_steps(slots, params)

    one(batches[0])  # warm-up
    t0 = time.perf_counter()
    for b in batches:
        one(b)
    return clients * steps / (time.perf_counter() - t0)


def _head() -> Any:
    from schemas.model import HeadConfig

    return HeadConfig(**HEAD)


def _optim() -> Any:
    from schemas.model import OptimizerConfig

    return OptimizerConfig()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="joynexus bench lowlevel", description=__doc__)
    p.add_argument("--clients", default="1,4,8", help="comma-separated client counts")
    p.add_argument("--steps", type=int, default=20, help="forward_backward + optim_step pairs")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    torch.set_num_threads(args.torch_threads)
    backbone = Backbone.load("tiny")
    rows = []
    with tempfile.TemporaryDirectory(prefix="joynexus-bench-lowlevel-") as tmp:
        home = Path(tmp)
        stack = LocalStack(
            home,
            tenants=(),
            roles={"master": 1, "trainer": 1},
            role_args={"trainer": ["--torch-threads", str(args.torch_threads)]},
        )
        try:
            info = stack.start(120)
            asyncio.run(over_bus(info, 1, 3, args.batch_size, "warm"))
            for n in counts:
                bus = asyncio.run(over_bus(info, n, args.steps, args.batch_size, "bench"))
                local = in_process(backbone, n, args.steps, args.batch_size)
                rows.append(
                    {
                        "clients": n,
                        **bus,
                        "in_process_steps_per_s": local,
                        "pipelined_vs_in_process": bus["pipelined_steps_per_s"] / local,
                        "round_trip_vs_in_process": bus["round_trip_steps_per_s"] / local,
                    }
                )
        finally:
            stack.stop()
    print(
        f"{'clients':>7} {'round trip ms':>13} {'pipelined st/s':>14} {'in-process st/s':>15} "
        f"{'pipelined/in-proc':>17} {'round trip/in-proc':>18}"
    )
    for r in rows:
        print(
            f"{r['clients']:>7} {r['round_trip_ms']:>13.1f} {r['pipelined_steps_per_s']:>14.1f} "
            f"{r['in_process_steps_per_s']:>15.1f} {r['pipelined_vs_in_process']:>17.2f} "
            f"{r['round_trip_vs_in_process']:>18.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
