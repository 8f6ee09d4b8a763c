"""The ``joynexus`` command: the tenant commands of :mod:`clients.cli` plus the operator ones.

``up`` runs the local stack, ``scale`` resizes a role in it, ``demo`` and ``bench`` drive one;
``model``, ``env`` and ``data record`` / ``data inspect``, which need no stack, are
:mod:`bench.offlinecmd`'s. Each imports what it needs (the launcher, the model core, a
benchmark) inside its command, so ``joynexus submit`` loads no more than the SDK.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bench.observe import add_observe_commands
from bench.offlinecmd import add_offline_commands
from bench.tenantcmd import add_tenant_commands
from clients import cli as tenant_cli
from clients.clikit import Command, add_command, command_client, home_of

if TYPE_CHECKING:
    from clients.clikit import Subcommands


def _up(args: argparse.Namespace) -> int:
    from services import launcher

    try:
        backbones = [launcher.backbone_of(b) for b in args.backbone or ["tiny"]]
    except ValueError as exc:
        print(f"joynexus up: {exc}", file=sys.stderr)
        return 2
    ids = [b.backbone_id for b in backbones]
    if len(set(ids)) != len(ids):
        print(f"joynexus up: two --backbone values share an id: {ids}", file=sys.stderr)
        return 2
    auth = not args.no_auth
    split = args.backbone_service
    if args.cluster != 1 and args.cluster < 3:
        print(
            "joynexus up: --cluster needs 3 or more nodes (a majority must survive)",
            file=sys.stderr,
        )
        return 2
    if args.check:
        return int(
            launcher.check_stack(
                home_of(args),
                args.timeout,
                backbones,
                auth=auth,
                backbone_service=split,
                cluster=args.cluster,
            )
        )
    try:
        return int(
            launcher.run_stack(
                home_of(args),
                backbones=backbones,
                auth=auth,
                backbone_service=split,
                cluster=args.cluster,
                trace_file=args.trace_file,
                metrics_port=args.metrics_port,
            )
        )
    except launcher.StackConfigError as exc:
        print(f"joynexus up: {exc}", file=sys.stderr)
        return 2


async def _served(args: argparse.Namespace) -> int:
    client = await command_client(args)
    try:
        records = await client.backbones()
    finally:
        await client.close()
    if not records:
        print("no backbone is served (yet: a trainer announces its backbone once loaded)")
        return 1
    print(
        f"{'id':<24} {'architecture':<14} {'params':>10} {'image':>6} {'img tok':>7} "
        f"{'tokens':>7}  trainers inferencers"
    )
    for bid in sorted({r.backbone for r in records}):
        mine = [r for r in records if r.backbone == bid]
        r = mine[0]
        roles = [sum(x.role == role for x in mine) for role in ("trainer", "inferencer")]
        print(
            f"{bid:<24} {r.model_type:<14} {r.num_params:>10,} {r.image_size:>6} "
            f"{r.image_tokens:>7} {r.max_tokens:>7}  {roles[0]:>8} {roles[1]:>11}"
        )
    return 0


async def _cache(args: argparse.Namespace) -> int:
    from bench import servicequeries

    return await servicequeries.cache(args)


async def _queues(args: argparse.Namespace) -> int:
    from bench import servicequeries

    return await servicequeries.queues(args)


def _scale(args: argparse.Namespace) -> int:
    from services import stackops

    return int(stackops.request_scale(home_of(args), args.role, args.count))


def _demo(args: argparse.Namespace) -> int:
    from bench import demo
    from bench.scenario import config_of

    return int(demo.run(config_of(args, home_of(args))))


def _chaos(args: argparse.Namespace) -> int:
    from bench import chaos
    from bench.chaos_config import config_of

    return int(chaos.run(config_of(args, home_of(args) / "chaos")))


def _simulate(args: argparse.Namespace) -> int:
    from bench import simulate

    return int(simulate.main(args.sim_args) or 0)


def _bench_grouping(args: argparse.Namespace) -> int:
    from bench import grouping

    return int(grouping.main(args.bench_args) or 0)


def _bench_sft(args: argparse.Namespace) -> int:
    from bench import sft

    return int(sft.main(args.bench_args) or 0)


def _bench_inference(args: argparse.Namespace) -> int:
    from bench import inference

    return int(inference.main(args.bench_args) or 0)


def _bench_lowlevel(args: argparse.Namespace) -> int:
    from bench import lowlevel

    return int(lowlevel.main(args.bench_args) or 0)


def _bench_flood(args: argparse.Namespace) -> int:
    from bench import flood

    return int(flood.main(args.bench_args) or 0)


def _bench_rl(args: argparse.Namespace) -> int:
    from bench import rl

    return int(rl.main(args.bench_args) or 0)


def _bench_payloads(args: argparse.Namespace) -> int:
    from bench import payloads

    return int(payloads.main(args.bench_args) or 0)


def _bench_removal(args: argparse.Namespace) -> int:
    from bench import removal

    return int(removal.main(args.bench_args) or 0)


def _bench_learn(args: argparse.Namespace) -> int:
    from bench import learn

    return int(learn.main(args.bench_args) or 0)


#: name -> (its command, what it measures)
BENCHES: dict[str, tuple[Command, str]] = {
    "grouping": (_bench_grouping, "one grouped backbone forward vs one per tenant, in-process"),
    "sft": (_bench_sft, "N tenants' SFT jobs on one trainer vs one after another, over the bus"),
    "inference": (_bench_inference, "the (B, T) inference scheduler vs one forward per request"),
    "rl": (_bench_rl, "one RL job over the bus: success rate and return per iteration"),
    "learn": (
        _bench_learn,
        "demos -> SFT -> closed-loop success over the bus, against a blind baseline, then RL",
    ),
    "flood": (
        _bench_flood,
        "a calm tenant's SFT and act throughput with and without another tenant's flood",
    ),
    "payloads": (
        _bench_payloads,
        "a TRAIN episode inline vs by reference through the object store, per episode",
    ),
    "removal": (
        _bench_removal,
        "a tenant's job-rm and dataset-rm against how many job records it has",
    ),
    "lowlevel": (
        _bench_lowlevel,
        "low-level forward_backward + optim_step over the bus vs in process, 1/4/8 clients",
    ),
}


def _bench(args: argparse.Namespace) -> int:
    return BENCHES[args.what][0](args)


def add_operator_commands(sub: Subcommands) -> None:
    """``up``, ``backbones``, ``tenant``, ``scale``, ``demo``, ``bench``, ``model``, ``data``
    on ``sub``."""
    up = add_command(
        sub, "up", _up, home=True, help="run the local stack (embedded NATS + every role)"
    )
    up.add_argument("--check", action="store_true", help="start, wait for 5 healthy roles, stop")
    up.add_argument("--timeout", type=float, default=90.0, help="--check's bound in seconds")
    up.add_argument(
        "--backbone-service",
        action="store_true",
        help="run the frozen backbone in its own role (services.backbone); trainers and "
        "inferencers then hold only heads and take features from it",
    )
    up.add_argument(
        "--cluster",
        type=int,
        default=1,
        metavar="N",
        help="N nats-server nodes on loopback (3 or more) with streams, KV and object store "
        "at 3 replicas: losing one node loses nothing",
    )
    up.add_argument(
        "--trace-file",
        type=Path,
        metavar="FILE",
        help="every role appends its spans to this JSON-lines file (`joynexus trace` draws "
        "a job's); OTLP and console exporters come from the standard OTEL_* variables",
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="each role serves Prometheus metrics on its own port from PORT up (printed at "
        "start; needs opentelemetry-exporter-prometheus)",
    )
    up.add_argument(
        "--no-auth",
        action="store_true",
        help="open mode: one generated password for everyone, no per-tenant permissions",
    )
    up.add_argument(
        "--backbone",
        action="append",
        metavar="DIR|NAME|ID=DIR",
        help="serve this checkpoint directory or tiny name (repeatable; default: tiny); each "
        "gets its own trainer and inferencer, and specs name it by the id `up` prints",
    )
    add_command(
        sub,
        "backbones",
        lambda a: asyncio.run(_served(a)),
        bus=True,
        help="list the served backbones (id, architecture, parameters, image size, tokens)",
    )

    cache = sub.add_parser("cache", help="operator: the trainers' backbone feature caches")
    csub = cache.add_subparsers(dest="cache_cmd", required=True, metavar="command")
    for op, summary in (
        ("stats", "entries, bytes, hit rate of each trainer's feature cache"),
        ("clear", "drop every cached feature (the next epochs encode again)"),
    ):
        cp = add_command(csub, op, lambda a: asyncio.run(_cache(a)), bus=True, help=summary)
        cp.set_defaults(cache_op=op)
        cp.add_argument("--backbone", default="tiny", help="backbone id (default: tiny)")
        cp.add_argument("--wait", type=float, default=1.0, help="seconds to collect answers")

    qp = add_command(
        sub,
        "queues",
        lambda a: asyncio.run(_queues(a)),
        bus=True,
        help="operator: queue depth and wait per tenant (jobs queued, training, inference)",
    )
    qp.add_argument("--wait", type=float, default=2.5, help="seconds to collect reports")

    add_tenant_commands(sub)

    sc = add_command(
        sub,
        "scale",
        _scale,
        home=True,
        help="change how many processes of a role the local stack runs",
    )
    sc.add_argument("role", choices=["envs", "inferencer"])
    sc.add_argument("count", type=int)

    from bench.scenario import add_arguments as demo_arguments

    demo = add_command(
        sub,
        "demo",
        _demo,
        home=True,
        help="the paper's scenario on a local stack: 3 RL + 1 SFT tenants, isolated vs shared",
    )
    demo_arguments(demo)
    from bench.chaos_config import add_arguments as chaos_arguments

    chaos = add_command(
        sub,
        "chaos",
        _chaos,
        home=True,
        help="a 3-tenant workload while roles (--broker: the NATS server) are SIGKILLed; "
        "checks nothing was lost, repeated or changed",
    )
    chaos_arguments(chaos)
    sim = add_command(
        sub,
        "simulate",
        _simulate,
        help="discrete-event model of the services: isolated vs shared, projected to N tenants "
        "(what follows goes to it: --help for its options)",
    )
    sim.add_argument("sim_args", nargs=argparse.REMAINDER, help="the simulator's own options")

    b = add_command(
        sub,
        "bench",
        _bench,
        help="benchmarks (what follows the name goes to the bench: --help for its options)",
        description="\n".join(f"{name}: {summary}" for name, (_, summary) in BENCHES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("what", choices=BENCHES, help="which benchmark")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    add_offline_commands(sub)


def build_parser() -> argparse.ArgumentParser:
    """Every ``joynexus`` command."""
    parser, sub = tenant_cli.build_parser(
        "JoyNexus: multi-tenant VLA post-training over NATS JetStream."
    )
    add_operator_commands(sub)
    add_observe_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``joynexus`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["simulate"]:  # its options are its own (argparse's REMAINDER misses flags)
        from bench import simulate

        return int(simulate.main(args[1:]) or 0)
    return tenant_cli.main(args, build_parser())


if __name__ == "__main__":
    sys.exit(main())
