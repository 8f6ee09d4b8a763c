"""The inferencer's settings: flags and ``JOYNEXUS_*`` variables (:mod:`bus.config`)."""

from __future__ import annotations

from pydantic import Field

from bus.config import HeadsConfig
from schemas.limits import InputLimits


class InferencerConfig(HeadsConfig):
    """Inferencer settings (flags ``--target-batch 8`` or env ``JOYNEXUS_TARGET_BATCH=8``)."""

    # Defaults measured on the tiny backbone, 1 torch thread, 2 shared CPU cores (see
    # bench/inference.py): a forward's cost per observation falls until ~16
    # (18 ms at 1, 5 ms at 8, 3.8 ms at 16, 4.7 ms at 32), and through the bus B=16 beat
    # B=8 (201 vs 145 req/s, p50 80 vs 108 ms with 16 sessions) and B=32 (158 vs 120 req/s
    # with 32). T=5 ms gathers most of a closed-loop round of 8 tenants (7 of 8 per forward,
    # 2x the per-request throughput) for at most 5 ms more latency when alone.
    target_batch: int = Field(
        16, ge=1, description="B: observations per grouped forward (dispatch when reached)."
    )
    max_wait_ms: float = Field(
        5.0, ge=0, description="T: dispatch when the oldest waiting request is this old."
    )
    max_versions_per_job: int = Field(
        3, ge=1, description="Resident policy versions per job (older ones serve pinned calls)."
    )
    max_resident_jobs: int = Field(
        64,
        ge=1,
        description="Jobs whose policies stay resident (the least recently served dropped "
        "first; its next request loads it again).",
    )
    ack_wait_s: float = Field(
        5.0, gt=0, description="Consumer ack wait: a dead replica's requests return this fast."
    )
    max_deliver: int = Field(3, ge=1, description="Deliveries before a request is dead.")
    checkpoint_read_s: float = Field(
        60.0,
        gt=0,
        description="Reading a policy checkpoint may take this long; then its requests are "
        "handed back (one whose chunks are gone would otherwise hold them for ever).",
    )
    # A request's answer waits on the encode: a shorter wait than the trainer's.
    encode_timeout_s: float = Field(
        10.0, gt=0, description="With --backbone-service: wait this long for an encode answer."
    )
    limit: InputLimits = Field(
        default_factory=InputLimits, description="Input bounds (--limit-*, JOYNEXUS_LIMIT_*)."
    )
