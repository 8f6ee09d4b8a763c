"""What a tenant's removal costs (``joynexus bench removal``).

``job-rm`` and ``dataset-rm`` refuse while a job of the tenant that has not ended needs what
they remove, and find out by reading every job record the tenant has (records are kept
until it removes them). This drives the master's responders (in process, on an embedded
server) as a tenant's client would: the tenant has N ended jobs, and the table gives the
milliseconds of a ``job-rm`` and of a ``dataset-rm`` for each N, and per thousand records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bus.codec import encode
from bus.connect import connect
from bus.datacache import DatasetCache
from bus.datasets import register_path
from bus.declare import declare
from bus.server import EmbeddedServer
from clients.sdk import Client
from schemas import subjects
from schemas.jobs import JobRecord, job_key
from services.master.queries import Queries


async def measure(
    url: str, root: Path, tenant: str, records: int, repeats: int
) -> dict[str, float]:
    """Median milliseconds of a job-rm and a dataset-rm for ``tenant`` with ``records``
    ended jobs (a job removed is replaced before the next removal)."""
    nc = await connect(url)
    js = nc.jetstream()
    await declare(js)
    queries = await Queries.on_bus(js, DatasetCache(root / "cache"))
    await queries.subscribe(nc)
    client = await Client.connect(url)
    try:
        jobs = await js.key_value(subjects.KV_JOBS)
        now = time.time()
        spec = json.dumps({"kind": "sft", "dataset": "other"}).encode()
        for i in range(records):
            record = JobRecord(tenant, f"j{i}", "sft", "succeeded", spec, now, now)
            await jobs.put(job_key(tenant, record.job_id), encode(record))
        job_ms, dataset_ms = [], []
        for r in range(repeats):
            started = time.perf_counter()
            await client.remove_job(tenant, f"j{r}")
            job_ms.append((time.perf_counter() - started) * 1e3)
            record = JobRecord(tenant, f"x{r}", "sft", "succeeded", spec, now, now)
            await jobs.put(job_key(tenant, record.job_id), encode(record))  # N again
            data = root / f"data-{tenant}-{r}"
            data.mkdir()
            await register_path(js, tenant, f"d{r}", data)
            started = time.perf_counter()
            await client.remove_dataset(tenant, f"d{r}")
            dataset_ms.append((time.perf_counter() - started) * 1e3)
        return {
            "records": float(records),
            "job_rm_ms": statistics.median(job_ms),
            "dataset_rm_ms": statistics.median(dataset_ms),
        }
    finally:
        await client.close()
        await queries.close()
        await nc.close()


async def run(counts: list[int], repeats: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = EmbeddedServer(root / "nats").start()
        try:
            # One tenant per count: a removal reads only its own tenant's records.
            return [await measure(server.url, root, f"t{n}", n, repeats) for n in counts]
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="joynexus bench removal", description=__doc__)
    parser.add_argument("--records", default="100,1000", help="ended jobs of the tenant")
    parser.add_argument("--repeats", type=int, default=5, help="removals per count")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    counts = [max(1, min(int(n), 100_000)) for n in args.records.split(",")]
    rows = asyncio.run(run(counts, max(1, min(args.repeats, 50))))
    print(f"{'records':>8}{'job-rm ms':>11}{'dataset-rm ms':>15}{'job-rm ms / 1k':>16}")
    for r in rows:
        per_k = r["job_rm_ms"] / r["records"] * 1000
        print(
            f"{int(r['records']):>8}{r['job_rm_ms']:>11.1f}{r['dataset_rm_ms']:>15.1f}"
            f"{per_k:>16.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
