"""The operator's ``joynexus tenant`` commands: identities, limits and the server's auth
config in the home (:mod:`bus.tenantadmin`), applied to a running stack at once, or with
``--url`` to another bus (compose's)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from clients.clikit import add_command, home_of

if TYPE_CHECKING:
    from clients.clikit import Subcommands


def _tenant(args: argparse.Namespace) -> int:
    """``joynexus tenant add|list|rotate|revoke|set|sync``: change the home's registry, then
    apply it to the running stack (reload + tenants KV + bucket) if one runs there."""
    from nats.errors import Error as NatsError
    from nats.js.errors import APIError

    from bus import tenantadmin
    from bus.auth import load_registry
    from bus.local import read_stack_info
    from schemas.tenants import TenantLimits

    home = home_of(args)
    op = args.tenant_cmd
    url: str | None = None
    try:
        if op == "list":
            print("\n".join(tenantadmin.describe(load_registry(home))))
            return 0
        if op == "init":
            tenantadmin.init_home(home)
            print(f"service and operator creds in {tenantadmin.creds_dir(home)}")
            print(f"server authorization config: {tenantadmin.auth_conf(home)}")
        limit_flags = {k: getattr(args, k, None) for k in tenantadmin.LIMIT_FLAGS}
        if op == "add":
            limits = tenantadmin.limits_with(TenantLimits(), **limit_flags)
            print(f"tenant {args.name}: creds {tenantadmin.add_tenant(home, args.name, limits)}")
        elif op == "rotate":
            print(f"tenant {args.name}: new key in {tenantadmin.rotate_tenant(home, args.name)}")
        elif op == "revoke":
            tenantadmin.revoke_tenant(home, args.name)
            print(f"tenant {args.name}: revoked (its data is kept)")
        elif op == "server-limits":
            server = tenantadmin.set_server_limits(
                home,
                max_payload=args.max_payload,
                max_pending=args.max_pending,
                max_subscriptions=args.max_subscriptions,
                max_connections=args.max_connections,
            )
            print(f"per-connection limits: {server}")
        elif op == "set":
            limits = tenantadmin.set_limits(home, args.name, **limit_flags)
            print(f"tenant {args.name}: {limits}")
        info = read_stack_info(home)
        url = args.url or (info.url if info and info.auth else None)
        replicas = args.replicas or (info.replicas if info else 1)
        applied = asyncio.run(tenantadmin.apply(home, url, replicas=replicas))
    except (tenantadmin.TenantAdminError, ValueError) as exc:
        print(f"joynexus tenant {op}: {exc}", file=sys.stderr)
        return 2
    except APIError as exc:  # the bus answered: it refused what was asked (a bucket's size)
        print(
            f"joynexus tenant {op}: saved in {home}, but the bus at {url} refused it "
            f"({exc.description or exc}); change it with `joynexus tenant set` and sync again",
            file=sys.stderr,
        )
        return 1
    except (NatsError, OSError, TimeoutError) as exc:
        if url is None:  # the home itself (its files), before any bus was asked
            print(f"joynexus tenant {op}: {exc}", file=sys.stderr)
            return 1
        print(
            f"joynexus tenant {op}: saved in {home}, but the bus at {url} was not reached "
            f"({type(exc).__name__}: {exc}); `joynexus tenant sync --url URL` writes it "
            "once the bus answers",
            file=sys.stderr,
        )
        return 1
    if applied.reloaded:
        print("the local stack's server reloaded its authorization config")
    else:
        print(f"no server runs under {home}: `joynexus up` applies it (elsewhere: SIGHUP it)")
    if applied.synced:
        print(f"tenant records and buckets written to {url}")
    return 0


def add_tenant_commands(sub: Subcommands) -> None:
    """``joynexus tenant init|add|list|rotate|revoke|set|server-limits|sync`` on ``sub``."""
    tn = sub.add_parser("tenant", help="operator: tenants' identities and limits")
    tsub = tn.add_subparsers(dest="tenant_cmd", required=True, metavar="command")
    for name, summary in (
        ("init", "create the service and operator identities and the server's auth config"),
        ("add", "create a tenant: its creds file under <home>/creds/, its bucket, its limits"),
        ("list", "list tenants, their state and limits"),
        ("rotate", "give a tenant a new key (the old one stops working at once)"),
        ("revoke", "revoke a tenant (its connections are closed; its data is kept)"),
        ("set", "change a tenant's limits"),
        ("server-limits", "change the per-connection limits (the same for every identity)"),
        ("sync", "apply the registry again: reload the server, write records and buckets"),
    ):
        tp = add_command(tsub, name, _tenant, home=True, help=summary)
        tp.add_argument(
            "--url", help="also write tenant records and buckets to this bus (as the operator)"
        )
        tp.add_argument(
            "--replicas",
            type=int,
            choices=(1, 3, 5),
            help="replicas of a new bucket (default: the local stack's; 3 for compose's "
            "cluster profile)",
        )
        if name == "server-limits":
            for flag, what in (
                ("--max-payload", "largest message in bytes"),
                ("--max-pending", "bytes buffered for a slow client before it is cut off"),
                ("--max-subscriptions", "subscriptions per connection (0 = unlimited)"),
                ("--max-connections", "connections on the server (0 = unlimited)"),
            ):
                tp.add_argument(flag, type=int, help=what)
        if name not in ("list", "init", "server-limits", "sync"):
            tp.add_argument("name", help="tenant id")
        if name in ("add", "set"):
            for flag, what in (
                ("--max-jobs", "top-level jobs running at once (more wait, queued)"),
                ("--max-slots", "trainer slots at once (SFT, RL and session jobs: one each)"),
                ("--max-env-sessions", "simulator sessions of its RL/eval jobs at once"),
                ("--max-inflight-samples", "samples of an SFT job streamed, not committed"),
                ("--max-job-priority", "the highest priority one of its jobs may ask"),
                ("--max-storage", "bytes its bucket may hold"),
            ):
                tp.add_argument(flag, type=int, help=what)
            tp.add_argument(
                "--priority",
                choices=["low", "normal", "high"],
                help="priority class: weight 1, 2 or 4 on the trainer and in inference batches",
            )
