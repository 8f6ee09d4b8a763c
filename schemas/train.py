"""Messages on a tenant's Training Queue subject ``nexus.train.<backbone>.<tenant>``.

Slot control (open/close) travels in the same subject as the tenant's data, so it is ordered
with it for free. Decode with :data:`TRAIN_DECODER`.
"""

from __future__ import annotations

import msgspec

from schemas.model import HeadConfig, OptimizerConfig
from schemas.tensor import Tensor


class OpenSlot(msgspec.Struct, frozen=True, tag="open_slot", forbid_unknown_fields=True):
    """Create the tenant's slot for a job. Acked only once the slot's version-0 checkpoint is
    committed, so the slot's spec is durable before any data is applied to it."""

    tenant: str
    job_id: str
    head: HeadConfig
    optimizer: OptimizerConfig
    seed: int
    #: Optimizer steps the job will take; the step that reaches it finishes the job.
    total_steps: int
    num_views: int = 1
    token_budget: int = 48
    #: Commit a checkpoint at least every this many steps.
    checkpoint_every: int = 10
    #: Deficit-round-robin weight of this tenant (1 = fair share).
    priority: int = 1


class CloseSlot(msgspec.Struct, frozen=True, tag="close_slot", forbid_unknown_fields=True):
    """Drop the tenant's slot for a job (finished or cancelled); its checkpoints remain."""

    tenant: str
    job_id: str
    reason: str = ""


class SFTBatch(msgspec.Struct, frozen=True, tag="sft_batch", forbid_unknown_fields=True):
    """One supervised micro-batch = one optimizer step of the job (``step`` is its 0-based
    index). Shapes: ``images`` uint8 (B, V, H, W, 3); ``proprio`` float32 (B, P);
    ``actions`` float32 (B, C, A); ``action_pad`` bool (B, C), True where the chunk runs past
    the episode's end (those targets are the episode's last action repeated)."""

    tenant: str
    job_id: str
    step: int
    epoch: int
    batch_index: int
    images: Tensor
    instructions: list[str]
    proprio: Tensor
    actions: Tensor
    action_pad: Tensor


TrainMessage = OpenSlot | CloseSlot | SFTBatch
TRAIN_DECODER = msgspec.msgpack.Decoder(TrainMessage)


class PolicyRecord(msgspec.Struct, frozen=True):
    """Value of the ``policies`` KV entry ``<tenant>.<job>``: the latest committed version.

    ``stream_seq`` is the highest TRAIN stream sequence whose effect the checkpoint contains:
    a redelivered message at or below it is acknowledged without being applied again.
    """

    tenant: str
    job_id: str
    version: int
    step: int
    object_name: str
    sha256: str
    stream_seq: int
    slot: OpenSlot
    at: float
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    #: Batches of the job consumed (applied, or dropped as poison): a batch whose ``step`` is
    #: below this was already consumed, whatever its stream sequence (a re-publish after the
    #: duplicate window gets a new one).
    batches_done: int = 0


POLICY_RECORD_DECODER = msgspec.msgpack.Decoder(PolicyRecord)
