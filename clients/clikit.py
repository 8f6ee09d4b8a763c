"""What the command modules share: a command's client and stack options, and how a command
is added to a parser (:func:`add_command`: ``run(args) -> exit code`` in its defaults, which
:func:`clients.cli.main` dispatches). :mod:`clients.cli` builds the tenant commands with it,
:mod:`bench` the operator ones.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bus.local import DEFAULT_HOME
from clients.sdk import Client, RequestError
from schemas.ids import InvalidIdError

#: ``run(args)`` of a command: its exit code.
Command = Callable[[argparse.Namespace], int]
if TYPE_CHECKING:  # argparse's only name for what add_subparsers() returns
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def home_of(args: argparse.Namespace) -> Path:
    """The local stack's home: ``--home``, else ``JOYNEXUS_HOME``, else the default."""
    return Path(args.home or os.environ.get("JOYNEXUS_HOME") or DEFAULT_HOME)


R = TypeVar("R")


async def command_client(args: argparse.Namespace, tenant: str | None = None) -> Client:
    """A client for the command: on ``--url`` / ``JOYNEXUS_URL`` with ``--creds`` /
    ``JOYNEXUS_CREDS``, else on the local stack under the home, as ``tenant`` if its creds
    file is there."""
    url = getattr(args, "url", None) or os.environ.get("JOYNEXUS_URL")
    creds = getattr(args, "creds", None) or os.environ.get("JOYNEXUS_CREDS")
    if url:
        return await Client.connect(
            url,
            creds=creds,
            user=os.environ.get("JOYNEXUS_USER"),
            password=os.environ.get("JOYNEXUS_PASSWORD"),
        )
    return await Client.connect(home=home_of(args), creds=creds, tenant=tenant)


async def tenant_call(
    args: argparse.Namespace,
    command: str,
    call: Callable[[Client], Awaitable[R]],
    report: Callable[[R], str],
) -> int:
    """Run one request of ``args.tenant`` and print what it did (exit 0), or why the master
    or the SDK refused it (exit 1)."""
    client = await command_client(args, args.tenant)
    try:
        try:
            result = await call(client)
        except (RequestError, InvalidIdError) as exc:
            print(f"joynexus {command}: {exc}", file=sys.stderr)
            return 1
        print(report(result))
        return 0
    finally:
        await client.close()


def data_commands(sub: Subcommands) -> Subcommands:
    """The subcommands of the ``data`` group :func:`build_parser` made (to add more to)."""
    group = sub.choices["data"]
    for action in group._actions:  # argparse keeps its subparsers only there
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise AssertionError("the data group has no subcommands")


def add_stack_options(p: argparse.ArgumentParser, *, top: bool = False, bus: bool = True) -> None:
    """``--home`` and (``bus``) ``--url``, ``--creds``: on the top-level parser (``top``) and
    again on each command that uses them, so they may come before or after the command name.
    On a command they default to ``SUPPRESS``: not given there, the top level's value stands.
    """
    default = None if top else argparse.SUPPRESS
    p.add_argument(
        "--home",
        default=default,
        help=f"local stack home (default {DEFAULT_HOME}, env JOYNEXUS_HOME)",
    )
    if bus:
        p.add_argument(
            "--url",
            default=default,
            help="bus URL (env JOYNEXUS_URL, with JOYNEXUS_USER / JOYNEXUS_PASSWORD for a "
            "plain-auth bus; default: the local stack's)",
        )
        p.add_argument("--creds", default=default, help="NATS .creds file (env JOYNEXUS_CREDS)")


def add_command(
    sub: Subcommands,
    name: str,
    run: Command,
    *,
    home: bool = False,
    bus: bool = False,
    **kw: Any,
) -> argparse.ArgumentParser:
    """A command ``name`` that runs ``run(args)``. ``home``: it takes ``--home`` after its
    name too; ``bus``: ``--home``, ``--url`` and ``--creds``."""
    p: argparse.ArgumentParser = sub.add_parser(name, **kw)
    p.set_defaults(run=run)
    if home or bus:
        add_stack_options(p, bus=bus)
    return p
