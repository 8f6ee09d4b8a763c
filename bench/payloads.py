"""What a TRAIN message costs by reference (``joynexus bench payloads``).

Episodes of several sizes are published and read back the way the env worker and the
trainer do (:func:`bus.payloads.publish_train`; a pull consumer, then
:func:`bus.payloads.fetch_train` and :func:`bus.payloads.discard` for a reference), on two
embedded servers in the same run: one whose ``max_payload`` takes every episode inline and
one of the default 1 MiB, where the larger ones travel by reference. It prints per-episode
milliseconds for both and their ratio (a ratio measured in one run: absolute times on a
shared machine are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bus.codec import decode, encode
from bus.connect import connect
from bus.declare import declare
from bus.payloads import discard, fetch_train, publish_train
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.tensor import Tensor
from schemas.train import TRAIN_DECODER, PayloadRef, RolloutBatch

#: A server that takes the largest episode measured inline.
INLINE_MAX_PAYLOAD = 8 << 20
LIMIT = 64 << 20


def episode(tenant: str, job_id: str, steps: int, index: int = 0, views: int = 1) -> RolloutBatch:
    """An episode of ``steps`` 64 px frames of ``views`` views, random contents."""
    rng = np.random.default_rng(index)
    return RolloutBatch(
        tenant=tenant,
        job_id=job_id,
        iteration=0,
        episode=index,
        policy_version=1,
        images=Tensor.from_numpy(rng.integers(0, 255, (steps, views, 64, 64, 3), dtype=np.uint8)),
        instruction="push the cube",
        proprio=Tensor.from_numpy(rng.standard_normal((steps, 8)).astype(np.float32)),
        actions=Tensor.from_numpy(rng.standard_normal((steps, 1, 4)).astype(np.float32)),
        log_probs=Tensor.from_numpy(np.zeros(steps, np.float32)),
        values=Tensor.from_numpy(np.zeros(steps, np.float32)),
        rewards=Tensor.from_numpy(np.zeros(steps, np.float32)),
        terminated=False,
        truncated=True,
    )


async def round_trip(url: str, steps: int, views: int, count: int) -> dict[str, float]:
    """Publish ``count`` episodes, then consume them as the trainer does; ms per episode."""
    nc = await connect(url, name="bench-payloads")
    js = nc.jetstream()
    await declare(js)
    job_id = f"j{steps}x{views}"
    tenant = f"bench-{steps}x{views}"  # a subject (and work-queue consumer) per size
    subject = subjects.train("tiny", tenant)
    episodes = [episode(tenant, job_id, steps, i, views) for i in range(count)]
    sub = await js.pull_subscribe(subject, durable=f"bench-{job_id}", stream="TRAIN")
    started = time.perf_counter()
    for i, e in enumerate(episodes):
        await publish_train(js, subject, e, message_id=f"{job_id}-{i}", max_bytes=LIMIT)
    published = time.perf_counter()
    by_reference = 0
    read = 0
    while read < count:
        for msg in await sub.fetch(min(16, count - read), timeout=10):
            body = decode(TRAIN_DECODER, msg.data)
            ref = body if isinstance(body, PayloadRef) else None
            if ref is not None:
                by_reference += 1
                body = decode(TRAIN_DECODER, await fetch_train(js, ref, LIMIT))
            assert isinstance(body, RolloutBatch)
            await msg.ack()
            if ref is not None:
                await discard(js, ref)
            read += 1
    consumed = time.perf_counter()
    await nc.close()
    return {
        "bytes": float(len(encode(episodes[0]))),
        "publish_ms": (published - started) / count * 1e3,
        "consume_ms": (consumed - published) / count * 1e3,
        "by_reference": by_reference / count,
    }


async def run(sizes: list[tuple[int, int]], count: int) -> list[dict[str, float]]:
    rows = []
    with tempfile.TemporaryDirectory() as root:
        inline = EmbeddedServer(Path(root) / "inline", max_payload=INLINE_MAX_PAYLOAD).start()
        default = EmbeddedServer(Path(root) / "default").start()
        try:
            for steps, views in sizes:
                a = await round_trip(inline.url, steps, views, count)
                b = await round_trip(default.url, steps, views, count)
                rows.append(
                    {
                        "steps": float(steps),
                        "views": float(views),
                        "mb": a["bytes"] / 1e6,
                        "inline_ms": a["publish_ms"] + a["consume_ms"],
                        "default_ms": b["publish_ms"] + b["consume_ms"],
                        "by_reference": b["by_reference"],
                        "ratio": (b["publish_ms"] + b["consume_ms"])
                        / (a["publish_ms"] + a["consume_ms"]),
                    }
                )
        finally:
            inline.stop()
            default.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="joynexus bench payloads", description=__doc__)
    parser.add_argument("--episodes", type=int, default=40, help="episodes per size")
    parser.add_argument(
        "--sizes",
        default="40x1,80x1,50x2,100x2",
        help="episode sizes as steps x views of 64 px frames (comma-separated)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    rows = asyncio.run(run([(s[0], s[1]) for s in sizes], max(1, min(args.episodes, 1000))))
    print(
        f"{'steps x views':<14}{'MB':>7}{'inline ms':>11}{'1 MiB server ms':>17}"
        f"{'by reference':>14}{'ratio':>8}"
    )
    for r in rows:
        print(
            f"{int(r['steps'])}x{int(r['views']):<11}{r['mb']:>7.2f}{r['inline_ms']:>11.2f}"
            f"{r['default_ms']:>17.2f}{r['by_reference']:>14.0%}{r['ratio']:>7.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
