"""Operator commands that ask the running services over the bus and print their answers:
``joynexus cache stats|clear`` (every trainer of a backbone answers for its feature cache) and
``joynexus queues`` (the scheduling services' queue reports)."""

from __future__ import annotations

import argparse
import asyncio

from clients.clikit import command_client


async def cache(args: argparse.Namespace) -> int:
    """Every trainer's feature cache of the backbone (``stats``), or clear them (``clear``)."""
    from bus.codec import DecodeError, decode, encode
    from schemas import subjects
    from schemas.cachectl import CACHE_STATS_DECODER, CacheQuery, CacheStats

    client = await command_client(args)
    answers: list[CacheStats] = []
    try:
        nc = client.nc
        inbox = nc.new_inbox()

        async def collect(msg: object) -> None:
            try:
                answers.append(decode(CACHE_STATS_DECODER, msg.data))  # type: ignore[attr-defined]
            except DecodeError:
                pass

        sub = await nc.subscribe(inbox, cb=collect)
        await nc.publish(
            subjects.cache_ctl(args.backbone), encode(CacheQuery(args.cache_op)), reply=inbox
        )
        await asyncio.sleep(args.wait)  # every trainer of the backbone answers
        await sub.unsubscribe()
    finally:
        await client.close()
    if not answers:
        print(f"no trainer of backbone {args.backbone!r} answered within {args.wait:g}s")
        return 1
    print(
        f"{'trainer':<28} {'cache':>6} {'entries':>8} {'MiB':>8} {'budget MiB':>10} "
        f"{'hits':>8} {'misses':>8} {'hit rate':>8}"
    )
    for a in sorted(answers, key=lambda a: a.instance):
        print(
            f"{a.instance:<28} {('on' if a.enabled else 'off'):>6} {a.entries:>8} "
            f"{a.bytes / 2**20:>8.1f} {a.budget_bytes / 2**20:>10.1f} {a.hits:>8} "
            f"{a.misses:>8} {a.hit_rate:>8.1%}" + ("  (cleared)" if a.cleared else "")
        )
        if a.store_enabled:
            looked = a.store_hits + a.store_misses
            print(
                f"{'  bucket tier':<28} {'on':>6} {a.store_entries:>8} "
                f"{a.store_bytes / 2**20:>8.1f} {a.store_budget_bytes / 2**20:>10.1f} "
                f"{a.store_hits:>8} {a.store_misses:>8} "
                f"{(a.store_hits / looked if looked else 0.0):>8.1%}"
            )
    return 0


async def queues(args: argparse.Namespace) -> int:
    """Each scheduling service's queue per tenant: depth and the oldest item's wait."""
    from bus.codec import DecodeError, decode
    from schemas import subjects
    from schemas.metrics import QUEUE_REPORT_DECODER, QueueReport

    client = await command_client(args)
    latest: dict[tuple[str, str], QueueReport] = {}
    try:

        async def collect(msg: object) -> None:
            try:
                report = decode(QUEUE_REPORT_DECODER, msg.data)  # type: ignore[attr-defined]
            except DecodeError:
                return
            latest[(report.service, report.instance)] = report

        sub = await client.nc.subscribe(f"{subjects.QUEUE_METRICS}.>", cb=collect)
        await asyncio.sleep(args.wait)  # every service reports every 2 s
        await sub.unsubscribe()
    finally:
        await client.close()
    if not latest:
        print(f"no service reported its queue within {args.wait:g}s")
        return 1
    print(f"{'service':<28} {'queue':<6} {'tenant':<24} {'depth':>6} {'oldest wait s':>14}")
    for (_, instance), report in sorted(latest.items()):
        for t in report.tenants or []:
            print(
                f"{instance:<28} {report.queue:<6} {t.tenant:<24} {t.depth:>6} "
                f"{t.oldest_wait_s:>14.2f}"
            )
        if not report.tenants:
            print(f"{instance:<28} {report.queue:<6} {'(empty)':<24} {0:>6} {0:>14.2f}")
    return 0
