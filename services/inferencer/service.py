"""Inferencer: the Inference Model Service.

The process: it loads the backbone (with ``--backbone-service``, only what its heads need:
the backbone role encodes) and its cost table (how large a grouped forward may grow), then
serves the Inference Queue (:class:`~services.inferencer.serving.Inferencer`) and reports
its queue and each tenant's usage until it stops. A stop during the model load ends it at
once.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import torch

from bus.encoding import FeatureClient
from bus.placement import placed
from bus.queues import publish_queues
from bus.service import Runtime, serve
from bus.usage import UsageReporter
from services.inferencer.batching import BatchRunner
from services.inferencer.config import InferencerConfig
from services.inferencer.serving import Inferencer
from vla import costmodel
from vla.backbone import Backbone
from vla.costmodel import CostTable

log = logging.getLogger(__name__)


def load_backbone(config: InferencerConfig) -> Backbone:
    """Load the backbone and run one throwaway forward, so the first request does not pay
    for lazy initialisation. Blocking: the service runs it through ``Runtime.slow``."""
    backbone = Backbone.load(
        config.backbone, dtype=config.dtype, device=config.device, backbone_id=config.backbone_id
    )
    runner = BatchRunner(backbone)
    norm = runner.normaliser(1, 16)
    size = backbone.image_size
    inputs = norm.normalise_arrays(
        np.zeros((1, 1, size, size, 3), np.uint8), ["warm up"], np.zeros((1, 0), np.float32)
    )
    if config.backbone_service:
        backbone.release_weights()  # the backbone role encodes; this process holds heads
    else:
        backbone.encode(inputs)
    return backbone


async def serve_inferencer(rt: Runtime, config: InferencerConfig) -> None:
    """The service body: load the model (a stop meanwhile ends it at once), then serve."""
    backbone = await rt.slow(load_backbone, config)
    remote: FeatureClient | None = None
    costs: CostTable | None = None
    if config.backbone_service:  # the config refuses a cost table with it
        remote = FeatureClient(
            rt.nc,
            rt.js,
            asyncio.get_running_loop(),
            backbone.backbone_id,
            timeout_s=config.encode_timeout_s,
        )
    else:
        # Batches hold up to B observations: the table need not go further.
        costs = await rt.slow(
            costmodel.table_for,
            backbone,
            config.cost_table,
            max_samples=max(2, config.target_batch),
        )
    inferencer = Inferencer(rt, config, backbone, costs, remote)
    await inferencer.open()
    rt.gauges = inferencer.gauges
    rt.progress = lambda: inferencer.batches
    rt.spawn(
        publish_queues(rt.nc, rt.stop, "inferencer", rt.instance, "infer", inferencer.queue),
        "queue report",
    )
    usage = UsageReporter(
        rt.js,
        "inferencer",
        rt.instance,
        inferencer.usage,
        lambda: inferencer.batch_s,
        config.usage_report_s,
    )
    rt.spawn(usage.loop(rt.stop), "usage report")
    log.info(
        "serving %s (B=%d, T=%.1f ms)", inferencer.name, config.target_batch, config.max_wait_ms
    )
    async with placed(rt, backbone):
        await inferencer.run()
    await usage.report(timeout=1.0)  # what the last batches charged


async def run(config: InferencerConfig) -> None:
    """Entry point: serve the inferencer until SIGTERM/SIGINT."""
    torch.set_num_threads(config.torch_threads)

    async def body(rt: Runtime) -> None:
        await serve_inferencer(rt, config)

    await serve("inferencer", config, body)
