"""Inference benchmark through the real bus: the (B, T) scheduler vs one forward per request.

``joynexus bench inference`` (or ``python -m bench.inference``) starts an embedded
``nats-server`` in a temporary directory, commits policies for 8 tenants with mixed heads
(OFT with a value head, discrete, flow; different action and proprio dims) exactly as the
trainer would, and starts one real inferencer subprocess per mode, each on its own backbone
id (its own queue and durable consumer):

* ``grouped`` — the scheduler with ``--target-batch B --max-wait-ms T``;
* ``per_request`` — ``--target-batch 1 --max-wait-ms 0``: one backbone forward per request.

For each tenant count, one closed-loop client per tenant (times ``--sessions``) sends
single-observation requests back to back, like env sessions stepping a simulator: each
waits for its reply before sending the next. The modes take turns in short bursts (their
order flipping every round), so the drift of a shared machine's load hits both alike; only
one inferencer has work at a time. Reported per cell: throughput (median over its bursts of
replies per second of wall time), client-side p50/p99 latency (pooled over its bursts), and
the mean number of requests per backbone forward that the replies report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from bus import checkpoints as ckpt
from bus.codec import decode
from bus.connect import connect
from bus.declare import declare
from bus.inference import PolicyClient, observation
from bus.records import put_policy
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.health import HEARTBEAT_DECODER
from schemas.model import HeadConfig, Observation, OptimizerConfig
from schemas.train import OpenSlot, PolicyRecord
from services.inferencer.config import InferencerConfig
from vla.backbone import Backbone
from vla.slot import TenantSlot

MODES = ("grouped", "per_request")
MAX_TENANTS = 8
JOB = "bench"
TOKEN_BUDGET = 16
#: Tenant i's head; kinds and action schemas cycle so a group mixes them (as in bench.grouping).
HEADS = (
    HeadConfig(kind="oft", action_dim=7, chunk_len=4, proprio_dim=7, value_head=True),
    HeadConfig(kind="discrete", action_dim=3, chunk_len=4, proprio_dim=0),
    HeadConfig(kind="flow", action_dim=14, chunk_len=4, proprio_dim=14),
)
_ROOT = Path(__file__).resolve().parent.parent


def tenant_name(i: int) -> str:
    return f"bench-{i}"


async def commit_policies(js: JetStreamContext, hidden_size: int, count: int) -> None:
    """Version 1 of job ``bench`` for tenants ``bench-0..count-1``, committed the way the
    trainer commits its initial version: checkpoint object, then the ``policies`` record
    pointing at it."""
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    kv = await js.key_value(subjects.KV_POLICIES)
    for i in range(count):
        tenant, head = tenant_name(i), HEADS[i % len(HEADS)]
        slot = TenantSlot(f"{tenant}/{JOB}", head, OptimizerConfig(), hidden_size, seed=i)
        version = slot.publish_version()
        data = slot.to_bytes()
        sha = ckpt.digest(data)
        name = ckpt.object_name(tenant, JOB, version, sha)
        await ckpt.put_checkpoint(store, name, data)
        spec = OpenSlot(tenant, JOB, head, OptimizerConfig(), i, 1, token_budget=TOKEN_BUDGET)
        record = PolicyRecord(tenant, JOB, version, 0, name, sha, 0, spec, time.time())
        await put_policy(kv, record, last=0)


def _observation(head: HeadConfig, rng: np.random.Generator) -> Observation:
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    proprio = rng.standard_normal(head.proprio_dim).astype(np.float32)
    return observation([image], "pick up the red block", proprio)


def _start_inferencer(
    url: str, log: Path, backbone_id: str, target_batch: int, max_wait_ms: float
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(JOYNEXUS_URL=url, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = ["--backbone-id", backbone_id, "--instance", backbone_id]
    args += ["--target-batch", str(target_batch)]
    args += ["--max-wait-ms", str(max_wait_ms)]
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.inferencer", *args],
            cwd=_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


async def _wait_heartbeat(
    js: JetStreamContext, proc: subprocess.Popen[bytes], instance: str, log: Path, timeout: float
) -> None:
    """Until the inferencer's scheduler is up (its heartbeat carries the serving gauges).
    The key is known (``--instance``): one get per poll, no key listing."""
    kv = await js.key_value(subjects.KV_HEARTBEATS)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"inferencer exited with {proc.returncode}; see {log}")
        with contextlib.suppress(KeyNotFoundError):
            entry = await kv.get(f"inferencer.{instance}")
            if entry.value and "requests_served" in decode(HEARTBEAT_DECODER, entry.value).gauges:
                return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"inferencer did not heartbeat within {timeout}s; see {log}")


async def _session(
    client: PolicyClient, tenant: int, count: int, seed: int
) -> tuple[list[float], list[int]]:
    """One closed-loop session of ``count`` requests: latencies (s) and reported group
    sizes."""
    head = HEADS[tenant % len(HEADS)]
    rng = np.random.default_rng(seed)
    latencies: list[float] = []
    groups: list[int] = []
    for _ in range(count):
        obs = [_observation(head, rng)]
        t0 = time.perf_counter()
        reply = await client.act(
            tenant_name(tenant), JOB, obs, num_views=1, token_budget=TOKEN_BUDGET, timeout=60
        )
        latencies.append(time.perf_counter() - t0)
        groups.append(reply.group_size)
    return latencies, groups


async def _burst(
    client: PolicyClient, tenants: int, sessions: int, per_session: int, seed: int
) -> tuple[float, list[float], list[int]]:
    """All sessions at once, ``per_session`` requests each: (throughput, latencies, groups)."""
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(_session(client, c % tenants, per_session, seed + c) for c in range(tenants * sessions))
    )
    wall = time.perf_counter() - t0
    latencies = [x for lat, _ in results for x in lat]
    return len(latencies) / wall, latencies, [g for _, gs in results for g in gs]


def _summary(
    throughputs: list[float], latencies: list[float], groups: list[int]
) -> dict[str, float]:
    return {
        "throughput_per_s": statistics.median(throughputs),
        "p50_ms": 1000 * float(np.percentile(latencies, 50)),
        "p99_ms": 1000 * float(np.percentile(latencies, 99)),
        "mean_group_size": statistics.fmean(groups),
        "requests": len(latencies),
        "bursts": len(throughputs),
    }


async def _measure(
    clients: dict[str, PolicyClient],
    tenants: int,
    sessions: int,
    requests: int,
    warmup: int,
    repeats: int,
) -> list[dict[str, Any]]:
    """One tenant count, every mode. Modes alternate burst by burst (their order flipping
    every round), so load drift on a shared machine hits all of them alike; a cell's
    throughput is the median over its bursts, its latencies are pooled."""
    sessions_total = tenants * sessions
    per_session = max(1, -(-requests // (sessions_total * repeats)))
    stats: dict[str, tuple[list[float], list[float], list[int]]] = {
        mode: ([], [], []) for mode in clients
    }
    for client in clients.values():  # untimed: policies resident, steady state
        if warmup:
            await _burst(client, tenants, sessions, warmup, seed=0)
    order = list(clients)
    for r in range(repeats):
        for mode in order if r % 2 == 0 else order[::-1]:
            thr, lat, groups = await _burst(
                clients[mode], tenants, sessions, per_session, seed=1000 * (r + 1)
            )
            stats[mode][0].append(thr)
            stats[mode][1].extend(lat)
            stats[mode][2].extend(groups)
    return [{"tenants": tenants, "mode": m, **_summary(*stats[m])} for m in clients]


async def run_bench(
    tenants: Sequence[int],
    requests: int,
    *,
    target_batch: int,
    max_wait_ms: float,
    modes: Sequence[str] = MODES,
    sessions: int = 1,
    warmup: int = 3,
    repeats: int = 3,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Run every (tenants, mode) cell; returns the JSON document (see module docs).

    One inferencer per mode runs for the whole benchmark, each on its own backbone id (so
    its own queue); only one of them has requests at any time."""
    if not tenants or min(tenants) < 1 or max(tenants) > MAX_TENANTS:
        raise ValueError(f"tenant counts must be in 1..{MAX_TENANTS}, got {list(tenants)}")
    if min(requests, sessions, repeats) < 1 or warmup < 0:
        raise ValueError("requests, sessions and repeats must be >= 1, warmup >= 0")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    torch.set_num_threads(1)
    hidden_size = Backbone.load("tiny").hidden_size
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="joynexus-bench-", dir=workdir) as tmp:
        root = Path(tmp)
        server = EmbeddedServer(root / "nats").start()
        procs: list[subprocess.Popen[bytes]] = []
        nc: NATS | None = None
        try:
            nc = await connect(server.url, name="bench-inference")
            js = nc.jetstream()
            await declare(js)
            await commit_policies(js, hidden_size, MAX_TENANTS)
            clients: dict[str, PolicyClient] = {}
            for mode in modes:
                b, t = (target_batch, max_wait_ms) if mode == "grouped" else (1, 0.0)
                bid = f"tiny-{mode.replace('_', '-')}"
                log = root / f"inferencer-{mode}.log"
                procs.append(_start_inferencer(server.url, log, bid, b, t))
                await _wait_heartbeat(js, procs[-1], bid, log, timeout=120)
                clients[mode] = await PolicyClient.create(nc, bid, js)
            for count in tenants:
                for cell in await _measure(clients, count, sessions, requests, warmup, repeats):
                    cells.append(cell)
                    print(_row(cell), file=sys.stderr, flush=True)
            for client in clients.values():
                await client.close()
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if nc is not None:
                await nc.close()
            server.stop()
    return {
        "cells": cells,
        "target_batch": target_batch,
        "max_wait_ms": max_wait_ms,
        "sessions_per_tenant": sessions,
        "requests_per_cell": requests,
        "repeats": repeats,
        "backbone": "tiny",
        "torch_threads": 1,
        "cpus": os.cpu_count(),
    }


def _row(cell: dict[str, Any]) -> str:
    return (
        f"{cell['tenants']:>7} {cell['mode']:>12} {cell['throughput_per_s']:>9.1f} "
        f"{cell['p50_ms']:>8.1f} {cell['p99_ms']:>8.1f} {cell['mean_group_size']:>6.2f}"
    )


def format_table(result: dict[str, Any]) -> str:
    """Per cell: throughput, p50/p99 latency, mean group size; then grouped/per-request
    throughput ratios per tenant count."""
    lines = [
        f"inference through the bus: B={result['target_batch']}, "
        f"T={result['max_wait_ms']} ms, {result['sessions_per_tenant']} session(s)/tenant",
        f"{'tenants':>7} {'mode':>12} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'group':>6}",
    ]
    lines += [_row(c) for c in result["cells"]]
    by = {(c["tenants"], c["mode"]): c for c in result["cells"]}
    ratios = [
        f"{n} tenants {by[(n, 'grouped')]['throughput_per_s'] / p['throughput_per_s']:.2f}x"
        for (n, mode), p in sorted(by.items())
        if mode == "per_request" and (n, "grouped") in by
    ]
    if ratios:
        lines.append("grouped / per_request throughput: " + ", ".join(ratios))
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``joynexus bench inference``: run the cells, print the table, optionally write JSON."""
    defaults = InferencerConfig()
    p = argparse.ArgumentParser(
        prog="joynexus bench inference",
        description="Grouped (B, T) scheduling vs one forward per request, through the bus.",
    )
    p.add_argument("--tenants", type=_int_list, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    p.add_argument("--requests", type=int, default=120, help="timed requests per cell")
    p.add_argument("--sessions", type=int, default=1, help="closed-loop sessions per tenant")
    p.add_argument("--warmup", type=int, default=3, help="untimed requests per session")
    p.add_argument("--repeats", type=int, default=3, help="alternating bursts per cell")
    p.add_argument("--target-batch", type=int, default=defaults.target_batch, help="B")
    p.add_argument("--max-wait-ms", type=float, default=defaults.max_wait_ms, help="T")
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {MODES}")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        result = asyncio.run(
            run_bench(
                args.tenants,
                args.requests,
                target_batch=args.target_batch,
                max_wait_ms=args.max_wait_ms,
                modes=modes,
                sessions=args.sessions,
                warmup=args.warmup,
                repeats=args.repeats,
            )
        )
    except ValueError as exc:
        p.error(str(exc))
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
