"""Tasks on ``nexus.env.<tenant>.<job>`` (stream ENV), pulled by env workers."""

from __future__ import annotations

import msgspec


class StreamDataset(msgspec.Struct, frozen=True, tag="stream_dataset", forbid_unknown_fields=True):
    """Stream a tenant's offline dataset into its Training Queue as shuffled micro-batches,
    ``total_steps`` of them (cycling epochs), each with ``Nats-Msg-Id`` =
    (tenant, job, epoch, batch) so a restarted worker publishes nothing twice."""

    tenant: str
    job_id: str
    backbone: str
    dataset: str
    batch_size: int
    total_steps: int
    chunk_len: int
    num_views: int
    seed: int
    #: Leading state dims sent as proprio (the head's ``proprio_dim``).
    proprio_dim: int = 0
    #: Episodes held out of training (by :meth:`Dataset.split` with ``seed``).
    val_fraction: float = 0.0
    #: Most batches of this tenant in TRAIN at once, unconsumed or awaiting their
    #: checkpoint's commit (backpressure).
    max_in_flight: int = 4


EnvTask = StreamDataset
ENV_DECODER = msgspec.msgpack.Decoder(EnvTask)
