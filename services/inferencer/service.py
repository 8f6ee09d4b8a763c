"""Inferencer service (foundation stage): joins the bus, declares its shared durable consumer
on ``INFER`` and heartbeats. Serving ``act()`` requests lands with the inference issue; until
then no message is pulled, so requests wait in the work queue instead of being lost."""

from __future__ import annotations

from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from bus.config import BusConfig
from bus.service import Runtime, serve
from schemas import subjects

DURABLE = "inferencer"


class InferencerConfig(BusConfig):
    """Inferencer settings."""


async def run(config: InferencerConfig) -> None:
    """Entry point: serve the inferencer until SIGTERM/SIGINT."""

    async def body(rt: Runtime) -> None:
        try:
            await rt.js.consumer_info(subjects.STREAM_INFER, DURABLE)
        except NotFoundError:
            await rt.js.add_consumer(
                subjects.STREAM_INFER,
                ConsumerConfig(
                    durable_name=DURABLE,
                    filter_subject=f"{subjects.PREFIX}.infer.>",
                    ack_policy=AckPolicy.EXPLICIT,
                ),
            )
        await rt.stop.wait()

    await serve("inferencer", config, body)
