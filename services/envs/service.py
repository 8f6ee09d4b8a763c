"""Env worker service (foundation stage): joins the bus, declares the shared durable consumer
on ``ENV`` and heartbeats. Dataset streaming and simulator sessions land with the SFT and RL
issues."""

from __future__ import annotations

from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from bus.config import BusConfig
from bus.service import Runtime, serve
from schemas import subjects

DURABLE = "envs"


class EnvsConfig(BusConfig):
    """Env worker settings."""


async def run(config: EnvsConfig) -> None:
    """Entry point: serve an env worker until SIGTERM/SIGINT."""

    async def body(rt: Runtime) -> None:
        try:
            await rt.js.consumer_info(subjects.STREAM_ENV, DURABLE)
        except NotFoundError:
            await rt.js.add_consumer(
                subjects.STREAM_ENV,
                ConsumerConfig(
                    durable_name=DURABLE,
                    filter_subject=f"{subjects.PREFIX}.env.>",
                    ack_policy=AckPolicy.EXPLICIT,
                ),
            )
        await rt.stop.wait()

    await serve("envs", config, body)
