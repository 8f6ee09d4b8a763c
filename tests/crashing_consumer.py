"""A consumer process for the crash-loop test: it handles one durable of a tenant's TRAIN
subject through the real consume runtime and dies (``os._exit``, as a segfaulting simulator
would: no exception, no settle) on a message whose payload is ``crash``; every other payload
is appended to a file and acked (one starting ``slow`` after 2 s). ``python -m
tests.crashing_consumer URL DURABLE SUBJECT MAX_CRASHES OUT [CONCURRENCY]``; runs until
SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from nats.aio.msg import Msg

from bus.connect import connect
from bus.consume import Consumer
from bus.durable import ConsumerSpec

CRASH = b"crash"


async def main(
    url: str, durable: str, subject: str, max_crashes: int, out: Path, concurrency: int
) -> None:
    nc = await connect(url, name=f"crashing-{durable}")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    consumer = Consumer(nc.jetstream(), stop)
    spec = ConsumerSpec(
        "TRAIN", durable, subject, ack_wait_s=1.0, max_deliver=10, max_crashes=max_crashes
    )
    bound = await consumer.bind(spec)

    async def handle(msg: Msg) -> None:
        if msg.data == CRASH:
            os._exit(3)
        if msg.data.startswith(b"slow"):
            await asyncio.sleep(2.0)  # in flight when another message kills the process
        with out.open("ab") as f:
            f.write(msg.data + b"\n")

    await asyncio.gather(
        consumer.run(bound, handle, concurrency=concurrency), consumer.keep_alive()
    )
    await consumer.close()
    await nc.close()


if __name__ == "__main__":
    url, durable, subject, max_crashes, out = sys.argv[1:6]
    concurrency = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    asyncio.run(main(url, durable, subject, int(max_crashes), Path(out), concurrency))
