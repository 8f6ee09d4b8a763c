"""The operator's views of a running stack: ``joynexus top`` (live jobs, utilisation and
queues, :mod:`bench.top`), ``joynexus usage`` (the bill per tenant, :mod:`bench.usage`) and
``joynexus trace`` (a job's waterfall from the span file, :mod:`bench.traces`). Each command
imports what it draws with only when it runs."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from clients.clikit import add_command, command_client, home_of

if TYPE_CHECKING:
    from clients.clikit import Subcommands


def _trace(args: argparse.Namespace) -> int:
    from bench.traces import job_trace, read_spans, render
    from bus.local import read_stack_info

    path = args.trace_file
    if path is None:
        info = read_stack_info(home_of(args))
        if info is None or not info.trace_file:
            print(
                f"joynexus trace: no running stack under {home_of(args)} writes spans; give "
                "--trace-file FILE (the file `joynexus up --trace-file` was given)",
                file=sys.stderr,
            )
            return 2
        path = Path(info.trace_file)
    if not path.is_file():
        print(f"joynexus trace: no trace file {path}", file=sys.stderr)
        return 2
    spans = read_spans(path)
    job = job_trace(spans.spans, args.tenant, args.job)
    print(render(job, width=args.width, max_rows=args.max_spans))
    if spans.unreadable:
        print(f"({spans.unreadable} unreadable lines in {path} skipped)", file=sys.stderr)
    return 0 if job.rows else 1


async def _top(args: argparse.Namespace) -> int:
    from bench.top import run_top

    client = await command_client(args)
    try:
        url = client.nc.connected_url.netloc if client.nc.connected_url else ""
        return await run_top(
            client.nc, interval_s=args.interval, frames=args.frames, once=args.once, url=url
        )
    finally:
        await client.close()


def _top_command(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_top(args))
    except KeyboardInterrupt:
        return 0


async def _usage(args: argparse.Namespace) -> int:
    import json

    from bench.usage import collect, parse_since, render

    try:
        since = parse_since(args.since) if args.since else None
    except ValueError as exc:
        print(f"joynexus usage: {exc}", file=sys.stderr)
        return 2
    client = await command_client(args)
    try:
        document = await collect(client.js, since, args.tenant)
    finally:
        await client.close()
    if args.json:
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        print(render(document, whole_bill=args.tenant is None, by_job=args.by_job))
    return 0


def add_observe_commands(sub: Subcommands) -> None:
    """``top``, ``usage`` and ``trace`` on ``sub``."""
    top = add_command(
        sub,
        "top",
        _top_command,
        bus=True,
        help="live view of the stack: jobs and progress, each role's utilisation, queues per "
        "tenant (Ctrl-C stops it)",
    )
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--frames", type=int, help="stop after this many refreshes")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    usage = add_command(
        sub,
        "usage",
        lambda a: asyncio.run(_usage(a)),
        bus=True,
        help="what each tenant used: compute seconds per service, samples, env steps, act "
        "requests, checkpoint bytes (the operator's bill)",
    )
    usage.add_argument("--tenant", help="only this tenant's lines")
    usage.add_argument(
        "--since", help="from this point on: a duration back (30m, 2h, 7d) or an ISO date"
    )
    usage.add_argument("--json", action="store_true", help="the bill as JSON")
    usage.add_argument("--by-job", action="store_true", help="a line per job and service")
    trace = add_command(
        sub, "trace", _trace, home=True, help="draw a job's trace from the stack's span file"
    )
    trace.add_argument("tenant")
    trace.add_argument("job")
    trace.add_argument(
        "--trace-file",
        type=Path,
        metavar="FILE",
        help="the spans to read (default: the running stack's, from `up --trace-file`)",
    )
    trace.add_argument("--max-spans", type=int, default=150, help="rows of the waterfall")
    trace.add_argument("--width", type=int, default=40, help="the time bar's width")
