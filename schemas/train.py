"""Messages on a tenant's Training Queue subject ``nexus.train.<backbone>.<tenant>``.

Slot control (open/close) travels in the same subject as the tenant's data, so it is ordered
with it for free. Decode with :data:`TRAIN_DECODER`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.model import HeadConfig, OptimizerConfig
from schemas.tensor import Tensor


class PPOConfig(msgspec.Struct, frozen=True):
    """Per-tenant RL hyper-parameters (PPO; ``algorithm="grpo"`` swaps GAE for group-relative
    advantages over the episodes of one iteration)."""

    algorithm: str = "ppo"
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    epochs: int = 4
    minibatch_size: int = 64
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    #: Episodes that make one iteration (one update, one policy version).
    episodes_per_iteration: int = 8
    #: Rollouts from a policy older than ``current - max_policy_lag`` are dropped as stale.
    max_policy_lag: int = 0
    normalize_advantages: bool = True


class OpenSlot(msgspec.Struct, frozen=True, tag="open_slot"):
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
    #: RL jobs: the algorithm's settings (None: supervised).
    rl: PPOConfig | None = None
    #: Start from this checkpoint's module weights (e.g. an SFT job's final policy).
    init_object: str = ""
    init_sha256: str = ""
    #: A low-level session (:class:`ForwardBackward`, :class:`OptimStep`, :class:`SaveState`
    #: and :class:`LoadState` calls, ``total_steps`` of them at most) instead of a job's
    #: batches.
    session: bool = False
    #: Per-dimension proprio mean and std the policy standardises its proprio with (an SFT
    #: job's dataset statistics, ``meta/stats.json``); empty: keep the init policy's, or none.
    proprio_mean: tuple[float, ...] = ()
    proprio_std: tuple[float, ...] = ()
    #: Per-dimension action minimum and maximum the policy maps onto [-1, 1] (the SFT job's
    #: dataset statistics); empty: keep the init policy's, or none.
    action_min: tuple[float, ...] = ()
    action_max: tuple[float, ...] = ()


class CloseSlot(msgspec.Struct, frozen=True, tag="close_slot"):
    """Drop the tenant's slot for a job (finished or cancelled); its checkpoints remain."""

    tenant: str
    job_id: str
    reason: str = ""


class SFTBatch(msgspec.Struct, frozen=True, tag="sft_batch"):
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


class RolloutBatch(msgspec.Struct, frozen=True, tag="rollout"):
    """One episode of an RL iteration, as the env worker saw it under ``policy_version``.

    T transitions (one per policy query; a chunked head's C actions execute open-loop as
    one macro-action whose rewards are summed). Shapes: ``images`` uint8 (T, V, H, W, 3);
    ``proprio`` float32 (T, P); ``actions`` float32 (T, C, A); ``log_probs``, ``values``,
    ``rewards`` float32 (T,). ``bootstrap_value`` is V(s_T) when truncated, else 0.
    Observations travel inline (a 64x64 episode of 50 steps is ~0.6 MB).
    """

    tenant: str
    job_id: str
    iteration: int
    episode: int
    policy_version: int
    images: Tensor
    instruction: str
    proprio: Tensor
    actions: Tensor
    log_probs: Tensor
    values: Tensor
    rewards: Tensor
    terminated: bool
    truncated: bool
    success: bool = False
    bootstrap_value: float = 0.0


#: The objective of a :class:`ForwardBackward`: ``default`` is the head's own supervised loss
#: (regression, flow matching or cross-entropy by head kind); ``ppo`` PPO's clipped surrogate
#: over ``advantages`` (REINFORCE when ``old_log_probs`` is absent).
LossFn = Literal["default", "ppo"]


class ForwardBackward(msgspec.Struct, frozen=True, tag="forward_backward"):
    """A low-level session's call ``call`` (0-based; a session's calls apply strictly in this
    order, each exactly once): the loss of a batch and, unless ``backward`` is False (a
    ``forward``), its gradients added to those the session's slot holds.

    Shapes as in :class:`SFTBatch`: ``images`` uint8 (B, V, H, W, 3), ``proprio`` float32
    (B, P), ``actions`` float32 (B, C, A); ``advantages`` and ``old_log_probs`` float32 (B,)
    for ``loss_fn="ppo"``. It rides the same grouped backbone forward as other tenants' SFT
    steps. Answered by a :class:`schemas.events.CallResult` event."""

    tenant: str
    job_id: str
    call: int
    images: Tensor
    instructions: list[str]
    proprio: Tensor
    actions: Tensor
    backward: bool = True
    loss_fn: LossFn = "default"
    advantages: Tensor | None = None
    old_log_probs: Tensor | None = None
    #: PPO's ratio clip.
    clip: float = 0.2


class OptimStep(msgspec.Struct, frozen=True, tag="optim_step"):
    """Call ``call``: one AdamW update of the session's slot from the gradients accumulated
    since the last one (then cleared), with these hyper-parameters (Tinker's
    ``AdamParams``)."""

    tenant: str
    job_id: str
    call: int
    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: Max global norm of the accumulated gradients; 0 disables clipping.
    grad_clip: float = 0.0


class SaveState(msgspec.Struct, frozen=True, tag="save_state"):
    """Call ``call``: commit the session's slot as a new policy version now and keep it
    under ``name`` (names are the session's own, each used once; a named version outlives
    the retention of unnamed ones). ``for_sampler``: the version is for an inferencer
    (Tinker's ``save_weights_for_sampler``); a state is also that, so the flag only labels
    it."""

    tenant: str
    job_id: str
    call: int
    name: str
    for_sampler: bool = False


class LoadState(msgspec.Struct, frozen=True, tag="load_state"):
    """Call ``call``: reset the session's slot to the state saved under ``name`` (weights,
    and with ``optimizer`` the AdamW moments too; accumulated gradients are dropped)."""

    tenant: str
    job_id: str
    call: int
    name: str
    optimizer: bool = True


class PayloadRef(msgspec.Struct, frozen=True, tag="payload_ref"):
    """A TRAIN message too large for one NATS message (an episode of many steps or views, a
    large SFT batch), stored in the :data:`~schemas.subjects.OBJ_PAYLOADS` object store and
    sent as this reference in its place (DESIGN.md §2). The trainer fetches the object,
    checks its size and digest, and decodes it as the message it stands for; once that
    message is acknowledged the object is deleted (the bucket's max age removes the rest).
    """

    tenant: str
    job_id: str
    #: The referenced message's tag (``rollout``, ``sft_batch``): it must decode as that.
    kind: str
    #: Name in :data:`~schemas.subjects.OBJ_PAYLOADS`: ``train/<tenant>/<job>/<uuid>``.
    object_name: str
    #: Bytes of the stored message.
    size: int
    #: Hex SHA-256 of the stored message.
    sha256: str
    #: The stored message's ``step`` (an SFT batch) or ``iteration`` (an episode): a
    #: redelivery of a message already acknowledged, whose object is deleted, is recognised
    #: as applied by it.
    step: int


SessionCall = ForwardBackward | OptimStep | SaveState | LoadState
SESSION_CALL_TYPES = (ForwardBackward, OptimStep, SaveState, LoadState)

TrainMessage = (
    OpenSlot
    | CloseSlot
    | SFTBatch
    | RolloutBatch
    | ForwardBackward
    | OptimStep
    | SaveState
    | LoadState
    | PayloadRef
)
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
    #: A low-level session's named states (:class:`SaveState`): name → checkpoint object
    #: (kept past the version retention).
    saved: dict[str, str] = msgspec.field(default_factory=dict)
    #: Which session call saved each name of ``saved`` (name → call number): a copy of a
    #: later call naming it, refused then, is not answered with its version when it is
    #: delivered again. Records written before it (or rewritten by an older trainer) have
    #: none: every name is then taken as saved by whichever call asks.
    saved_calls: dict[str, int] = msgspec.field(default_factory=dict)


POLICY_RECORD_DECODER = msgspec.msgpack.Decoder(PolicyRecord)
