"""The ``joynexus`` command line.

Tenant commands (``submit``, ``status``, ``cancel``) use only the SDK. Operator commands
(``up``, ``model``, ``bench``, ``data``, ``demo``) need the model core or the services; they
import them lazily inside the command, so the SDK stays importable on a machine with only
``bus`` and ``schemas`` (see README, "Architecture").
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bus.local import DEFAULT_HOME
from clients.sdk import Client, JobFailed
from schemas.events import (
    Accepted,
    ErrorEvent,
    Metrics,
    PolicyPublished,
    Progress,
    Rejected,
    StateChanged,
)
from schemas.specs import JobSpecError


def _home(args: argparse.Namespace) -> Path:
    return Path(args.home or os.environ.get("JOYNEXUS_HOME") or DEFAULT_HOME)


async def _client(args: argparse.Namespace) -> Client:
    url = args.url or os.environ.get("JOYNEXUS_URL")
    if url:
        return await Client.connect(
            url,
            creds=args.creds or os.environ.get("JOYNEXUS_CREDS"),
            user=os.environ.get("JOYNEXUS_USER"),
            password=os.environ.get("JOYNEXUS_PASSWORD"),
        )
    return await Client.connect(home=_home(args))


def _progress_line(ev: Progress, started: float, now: float) -> str:
    width = 30
    frac = ev.step / ev.total_steps if ev.total_steps else 0.0
    bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
    elapsed = now - started
    eta = elapsed / frac - elapsed if frac > 0 else float("nan")
    m = ev.metrics
    if "return_mean" in m:  # an RL iteration
        return (
            f"\r[{bar}] iteration {ev.step}/{ev.total_steps} return {m['return_mean']:.3f} "
            f"success {m.get('success_rate', 0.0):.0%} ETA {eta:.0f}s"
        )
    return (
        f"\r[{bar}] {ev.step}/{ev.total_steps} loss {m.get('loss', float('nan')):.4f} "
        f"{m.get('samples_per_s', 0.0):.1f} samples/s ETA {eta:.0f}s"
    )


def _read_spec(path: str) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"cannot read {path}: {exc}") from exc


async def _submit(args: argparse.Namespace, document: Any) -> int:
    client = await _client(args)
    try:
        try:
            job = await client.submit(document, job_id=args.job_id)
        except JobSpecError as exc:
            print(f"invalid spec {args.file}: {exc}", file=sys.stderr)
            return 2
        print(f"submitted {job.tenant}/{job.job_id}", flush=True)
        if not args.watch:
            return 0
        started = time.time()
        status = "unknown"
        async for ev in job.events():
            match ev:
                case Progress():
                    print(_progress_line(ev, started, time.time()), end="", flush=True)
                case Accepted():
                    print(f"accepted ({ev.kind})", flush=True)
                case PolicyPublished():
                    pass
                case Metrics():
                    print(
                        "results: " + ", ".join(f"{k}={v:.4g}" for k, v in ev.metrics.items()),
                        flush=True,
                    )
                case Rejected():
                    print(f"\nrejected: {ev.reason}", flush=True)
                    status = "rejected"
                case ErrorEvent():
                    print(f"\nerror: {ev.message}", flush=True)
                case StateChanged():
                    print(f"\n{ev.status}{': ' + ev.reason if ev.reason else ''}", flush=True)
                    status = ev.status
        record = await client.status(job.tenant, job.job_id)
        if record is not None and record.metrics:
            print("metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in record.metrics.items()))
            print(f"policy version: {record.policy_version}")
        return 0 if status == "succeeded" else 1
    finally:
        await client.close()


async def _status(args: argparse.Namespace) -> int:
    client = await _client(args)
    try:
        records = await client.jobs(args.tenant)
        if args.job:
            records = [r for r in records if r.job_id == args.job]
            if not records:
                print(f"no job {args.job}", file=sys.stderr)
                return 1
        for r in records:
            metrics = ", ".join(f"{k}={v:.4g}" for k, v in r.metrics.items())
            print(
                f"{r.tenant}/{r.job_id}  {r.kind:<5} {r.status:<10} v{r.policy_version} "
                f"{metrics} {r.reason}".rstrip()
            )
        return 0
    finally:
        await client.close()


async def _cancel(args: argparse.Namespace) -> int:
    client = await _client(args)
    try:
        await client.cancel(args.tenant, args.job, args.reason)
        print(f"cancel requested for {args.tenant}/{args.job}")
        return 0
    finally:
        await client.close()


def _up(args: argparse.Namespace) -> int:
    launcher = importlib.import_module("services.launcher")
    if args.check:
        return int(launcher.check_stack(_home(args), timeout=args.timeout))
    return int(launcher.run_stack(_home(args)))


def _model_init(args: argparse.Namespace) -> int:
    tiny = importlib.import_module("vla.tiny")
    path = tiny.init_checkpoint(args.name, Path(args.out))
    print(f"wrote {args.name} checkpoint to {path}")
    return 0


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    modules = {
        "grouping": "vla.bench",
        "sft": "services.bench_sft",
        "inference": "services.bench_inference",
        "rl": "services.bench_rl",
    }
    return int(importlib.import_module(modules[args.what]).main(rest) or 0)


def _data(args: argparse.Namespace) -> int:
    datasets = importlib.import_module("services.envs.datasets")
    if args.data_cmd == "record":
        info = datasets.record(args.env, args.episodes, Path(args.out), seed=args.seed)
        print(f"recorded {info.total_episodes} episodes, {info.total_frames} frames to {args.out}")
    else:
        print(datasets.inspect(Path(args.dir)).format())
    return 0


def _scale(args: argparse.Namespace) -> int:
    launcher = importlib.import_module("services.launcher")
    return int(launcher.request_scale(_home(args), args.role, args.count))


def _demo(args: argparse.Namespace) -> int:
    demo = importlib.import_module("services.demo")
    return int(demo.main(_home(args)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="joynexus", description=__doc__.split("\n")[0])
    p.add_argument("--home", help=f"local stack home (default {DEFAULT_HOME}, env JOYNEXUS_HOME)")
    p.add_argument("--url", help="bus URL (env JOYNEXUS_URL; default: the local stack's)")
    p.add_argument("--creds", help="NATS .creds file (env JOYNEXUS_CREDS)")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="run the local stack (embedded NATS + every role)")
    up.add_argument("--check", action="store_true", help="start, wait for 5 healthy roles, stop")
    up.add_argument("--timeout", type=float, default=90.0, help="--check's bound in seconds")

    s = sub.add_parser("submit", help="submit a job spec (YAML)")
    s.add_argument("file")
    s.add_argument("--watch", action="store_true", help="follow progress until the job ends")
    s.add_argument("--job-id", help="job id (default: generated)")

    st = sub.add_parser("status", help="list jobs, or one job")
    st.add_argument("job", nargs="?")
    st.add_argument("--tenant")

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("tenant")
    c.add_argument("job")
    c.add_argument("--reason", default="")

    m = sub.add_parser("model", help="backbone checkpoints")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    mi = msub.add_parser("init", help="write a tiny backbone checkpoint directory")
    mi.add_argument("name", help="tiny, tiny-224 or tiny-llava")
    mi.add_argument("--out", required=True)

    b = sub.add_parser("bench", help="benchmarks (options after the name go to the bench)")
    b.add_argument("what", choices=["grouping", "sft", "inference", "rl"])

    sc = sub.add_parser("scale", help="change how many processes of a role the local stack runs")
    sc.add_argument("role", choices=["envs", "inferencer"])
    sc.add_argument("count", type=int)

    d = sub.add_parser("data", help="offline datasets")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    dr = dsub.add_parser("record", help="record scripted-expert demonstrations")
    dr.add_argument("--env", required=True)
    dr.add_argument("--episodes", type=int, required=True)
    dr.add_argument("--out", required=True)
    dr.add_argument("--seed", type=int, default=0)
    di = dsub.add_parser("inspect", help="summarise a dataset")
    di.add_argument("dir")

    sub.add_parser("demo", help="run the multi-tenant demo on a local stack")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.cmd != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        match args.cmd:
            case "up":
                return _up(args)
            case "submit":
                return asyncio.run(_submit(args, _read_spec(args.file)))
            case "status":
                return asyncio.run(_status(args))
            case "cancel":
                return asyncio.run(_cancel(args))
            case "model":
                return _model_init(args)
            case "bench":
                return _bench(args, rest)
            case "data":
                return _data(args)
            case "demo":
                return _demo(args)
            case "scale":
                return _scale(args)
    except (ConnectionError, JobFailed) as exc:
        print(f"joynexus: {exc}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.cmd}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
