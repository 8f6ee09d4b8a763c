"""The tenant half of the ``joynexus`` command line: ``submit``, ``watch``, ``status``,
``cancel``, ``rm``, ``export`` (``--rm``), ``data push``, ``data list`` and ``data rm``.

A command that names a tenant connects as that tenant: ``--creds`` / ``JOYNEXUS_CREDS`` if
given, else, against a local stack with auth, ``<home>/creds/<tenant>.creds`` (else the
operator's).

These commands use only the SDK (so only ``bus`` and ``schemas``). The operator commands
(``up``, ``demo``, ``bench``, ``data``, ``model``, ``scale``) need the services and the model
core; :mod:`bench.cli` adds them to :func:`build_parser`'s parser, and the installed
``joynexus`` script is :func:`bench.cli.main`. ``python -m clients.cli`` is the tenant-only
command for a machine that has just the SDK.

Every command reads ``run(args) -> exit code`` from its parser's defaults, so a composing
module adds commands with :func:`clients.clikit.add_command` and dispatches with :func:`main`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from nats.errors import Error as NatsError

from bus import tracing
from bus.codec import DecodeError, decode
from bus.datasets import DatasetStoreError
from bus.local import read_stack_info
from clients.clikit import add_command, add_stack_options, command_client, home_of, tenant_call
from clients.sdk import Client, Job, JobFailed, RequestError
from schemas.events import (
    Accepted,
    ErrorEvent,
    Metrics,
    PolicyPublished,
    Progress,
    Rejected,
    StateChanged,
)
from schemas.health import HEALTH_REPORT_DECODER, HEALTH_SUBJECT
from schemas.ids import InvalidIdError
from schemas.jobs import TERMINAL_STATUSES
from schemas.specs import JobSpecError

if TYPE_CHECKING:
    from clients.clikit import Subcommands


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


def _read_spec(path: str) -> dict[str, Any]:
    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"cannot read {path}: {exc}") from exc
    if not isinstance(document, dict):
        got = "an empty file" if document is None else f"a {type(document).__name__}"
        spec = "a job spec is a mapping (kind: ..., tenant: ...)"
        print(f"invalid spec {path}: {spec}, got {got}", file=sys.stderr)
        raise SystemExit(2)  # as for any other invalid spec
    return document


async def _follow(client: Client, job: Job) -> int:
    """Print a job's events until it ends; 0 if it succeeded."""
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


async def _submit(args: argparse.Namespace, document: Any) -> int:
    tenant = document.get("tenant") if isinstance(document, dict) else None
    client = await command_client(args, tenant if isinstance(tenant, str) else None)
    remote = getattr(args, "url", None) or os.environ.get("JOYNEXUS_URL")
    info = None if remote else read_stack_info(home_of(args))
    if info is not None and info.trace_file:  # the job's trace begins with this submit
        tracing.setup_tracing("joynexus-client", trace_file=info.trace_file)
    try:
        try:
            job = await client.submit(document, job_id=args.job_id)
        except JobSpecError as exc:
            print(f"invalid spec {args.file}: {exc}", file=sys.stderr)
            return 2
        print(f"submitted {job.tenant}/{job.job_id}", flush=True)
        return await _follow(client, job) if args.watch else 0
    finally:
        await client.close()
        tracing.flush_tracing()


async def _watch(args: argparse.Namespace) -> int:
    client = await command_client(args, args.tenant)
    try:
        return await _follow(client, Job(client, args.tenant, args.job))
    finally:
        await client.close()


async def _roles(client: Client) -> None:
    """The operator's view (a tenant is not let ask): every role instance as the health
    manager sees it, its latest actions, and each service's queue per tenant."""
    try:
        msg = await client.nc.request(HEALTH_SUBJECT, b"", timeout=2.0)
        report = decode(HEALTH_REPORT_DECODER, msg.data)
    except (NatsError, TimeoutError, DecodeError):
        return  # no health manager runs, or this identity may not ask
    print(
        f"{'role':<11} {'instance':<34} {'state':<10} {'pid':>7} {'uptime':>8} {'restarts':>8} "
        f"{'progress':>9} {'idle s':>7}  busy with"
    )
    for h in sorted(report.instances, key=lambda h: (h.role, h.instance)):
        print(
            f"{h.role:<11} {h.instance:<34} {h.state:<10} {h.pid:>7} {h.uptime_s:>7.0f}s "
            f"{report.restarts.get(h.role, 0):>8} {h.progress:>9} {h.progress_age_s:>7.0f}  "
            f"{h.busy_with}"
        )
    for event in report.events[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(event.at))
        print(f"  {when} {event.kind} {event.instance} (pid {event.pid}): {event.reason}")
    rows = [(q, t) for q in report.queues for t in q.tenants]
    if rows:
        print(f"\n{'queue':<7} {'service':<34} {'tenant':<24} {'depth':>6} {'oldest wait s':>14}")
        for q, t in rows:
            print(
                f"{q.queue:<7} {q.instance:<34} {t.tenant:<24} {t.depth:>6} "
                f"{t.oldest_wait_s:>14.2f}"
            )
    print()


async def _status(args: argparse.Namespace) -> int:
    client = await command_client(args, args.tenant)
    try:
        if args.tenant is None and args.job is None:
            await _roles(client)
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
    client = await command_client(args, args.tenant)
    try:
        await client.cancel(args.tenant, args.job, args.reason)
        name = f"{args.tenant}/{args.job}"
        records = [r for r in await client.jobs(args.tenant) if r.job_id == args.job]
        if not records:
            # Its submit may still be queued ahead of the cancel: the master answers then.
            print(
                f"cancel requested for {name}: no such job is recorded yet, so it is refused "
                f"unless its submit is still queued (joynexus watch {args.tenant} {args.job} "
                "says which)"
            )
        elif records[0].status in TERMINAL_STATUSES:
            print(f"{name} has ended already ({records[0].status}): nothing to cancel")
        else:
            print(f"cancel requested for {name} ({records[0].status})")
        return 0
    finally:
        await client.close()


def default_dataset_id(directory: Path) -> str:
    """A dataset id from a directory's name (``data/Reach_2D`` → ``reach-2d``)."""
    return re.sub(r"[^a-z0-9-]", "-", directory.resolve().name.lower()).strip("-")


async def _data_push(args: argparse.Namespace, dataset_id: str) -> int:
    directory = Path(args.dir)
    client = await command_client(args, args.tenant)
    try:
        try:
            pushed = await client.push_dataset(
                args.tenant,
                directory,
                dataset_id,
                on_file=lambda path: print(f"uploaded {path}", flush=True),
            )
        except (RequestError, DatasetStoreError, InvalidIdError) as exc:
            print(f"joynexus data push: {exc}", file=sys.stderr)
            return 1
        r = pushed.record
        print(
            f"dataset {r.dataset} in tenant {r.tenant}'s namespace: {r.files} files, "
            f"{r.bytes} bytes ({len(pushed.report.uploaded)} uploaded, "
            f"{len(pushed.report.skipped)} already there); name it as `dataset: {r.dataset}`"
        )
        return 0
    finally:
        await client.close()


async def _data_list(args: argparse.Namespace) -> int:
    client = await command_client(args, args.tenant)
    try:
        for r in await client.datasets(args.tenant):
            where = r.path if r.source == "registered" else f"{r.bucket}/{r.prefix}"
            print(f"{r.dataset:<24} {r.source:<10} {r.files:>6} files {r.bytes:>12} B  {where}")
        return 0
    finally:
        await client.close()


async def _rm(args: argparse.Namespace) -> int:
    return await tenant_call(
        args,
        "rm",
        lambda client: client.remove_job(args.tenant, args.job),
        lambda removed: (
            f"removed {args.tenant}/{', '.join(removed.jobs) or args.job}: "
            f"{removed.objects} stored objects ({removed.bytes} bytes), {removed.events} events"
        ),
    )


async def _data_rm(args: argparse.Namespace) -> int:
    return await tenant_call(
        args,
        "data rm",
        lambda client: client.remove_dataset(args.tenant, args.id),
        lambda removed: (
            f"dataset {removed.dataset} removed from tenant {args.tenant}'s namespace: "
            f"{'record and ' if removed.recorded else ''}{removed.files} stored objects, "
            f"{removed.bytes} bytes"
        ),
    )


async def _export(args: argparse.Namespace) -> int:
    if args.rm:
        return await tenant_call(
            args,
            "export --rm",
            lambda client: client.remove_export(args.tenant, args.job, args.version),
            lambda removed: (
                f"removed the exported copies of {args.tenant}/{args.job} version(s) "
                f"{', '.join(map(str, removed.versions))}: {removed.bytes} bytes"
            ),
        )
    return await tenant_call(
        args,
        "export",
        lambda client: client.export_policy(args.tenant, args.job, args.version, args.out),
        lambda path: f"exported {args.tenant}/{args.job} to {path}",
    )


def add_data_commands(dsub: Subcommands) -> None:
    """``push``, ``list`` and ``rm`` on the ``data`` command group's subcommands ``dsub``."""
    push = add_command(
        dsub,
        "push",
        lambda a: asyncio.run(_data_push(a, a.id or default_dataset_id(Path(a.dir)))),
        bus=True,
        help="upload a dataset directory into a tenant's namespace (resumable)",
    )
    push.add_argument("dir")
    push.add_argument("--tenant", required=True)
    push.add_argument("--id", help="dataset id (default: the directory's name)")
    ls = add_command(
        dsub,
        "list",
        lambda a: asyncio.run(_data_list(a)),
        bus=True,
        help="the datasets in a tenant's namespace",
    )
    ls.add_argument("--tenant", required=True)
    rm = add_command(
        dsub,
        "rm",
        lambda a: asyncio.run(_data_rm(a)),
        bus=True,
        help="remove a dataset from a tenant's namespace (its stored files too); refused "
        "while a job that has not ended names it",
    )
    rm.add_argument("id")
    rm.add_argument("--tenant", required=True)


def build_parser(
    description: str = "JoyNexus tenant commands.",
) -> tuple[argparse.ArgumentParser, Subcommands]:
    """The parser with the tenant commands, and its subcommands (to add more to)."""
    p = argparse.ArgumentParser(prog="joynexus", description=description)
    add_stack_options(p, top=True)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="command")

    s = add_command(
        sub,
        "submit",
        lambda a: asyncio.run(_submit(a, _read_spec(a.file))),
        bus=True,
        help="submit a job spec (YAML)",
    )
    s.add_argument("file")
    s.add_argument("--watch", action="store_true", help="follow progress until the job ends")
    s.add_argument("--job-id", help="job id (default: generated)")

    w = add_command(
        sub,
        "watch",
        lambda a: asyncio.run(_watch(a)),
        bus=True,
        help="follow a submitted job's events (from its first) until it ends",
    )
    w.add_argument("tenant")
    w.add_argument("job")

    st = add_command(
        sub, "status", lambda a: asyncio.run(_status(a)), bus=True, help="list jobs, or one job"
    )
    st.add_argument("job", nargs="?")
    st.add_argument("--tenant")

    c = add_command(sub, "cancel", lambda a: asyncio.run(_cancel(a)), bus=True, help="cancel a job")
    c.add_argument("tenant")
    c.add_argument("job")
    c.add_argument("--reason", default="")

    rm = add_command(
        sub,
        "rm",
        lambda a: asyncio.run(_rm(a)),
        bus=True,
        help="remove a job that has ended, with its policy versions, exported copies and "
        "events (a pipeline's stages too); its id is not used again",
    )
    rm.add_argument("tenant")
    rm.add_argument("job")

    e = add_command(
        sub,
        "export",
        lambda a: asyncio.run(_export(a)),
        bus=True,
        help="download a committed policy version of a job (verified by its sha256)",
    )
    e.add_argument("tenant")
    e.add_argument("job")
    e.add_argument("--version", type=int, default=0, help="policy version (default: latest)")
    e.add_argument("--out", default=".", help="directory to write <job>-v<version>.ckpt to")
    e.add_argument(
        "--rm",
        action="store_true",
        help="instead delete the exported copy kept in the tenant's bucket (of --version; "
        "default: every one of the job's), giving its storage back",
    )

    d = sub.add_parser("data", help="datasets: push, list (and record, inspect with joynexus)")
    add_data_commands(d.add_subparsers(dest="data_cmd", required=True, metavar="command"))
    return p, sub


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Parse ``argv`` with ``parser`` (default: the tenant commands') and run the command."""
    parser = parser or build_parser()[0]
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        return int(args.run(args))
    except (ConnectionError, JobFailed, RequestError) as exc:
        print(f"joynexus: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError, TimeoutError) as exc:
        # A bad id or value (InvalidIdError), an unreadable creds file, a follower's idle
        # limit: said in one line, not a traceback.
        print(f"joynexus: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
