"""User-facing job specs (pydantic): what a tenant writes in ``sft.yaml``.

Unknown keys are rejected, and every error message names the field path
(``head.action_dim: ...``) so a tenant can fix the file without reading our code.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from schemas.ids import ID_PATTERN, InvalidIdError, validate_id
from schemas.model import HeadConfig, OptimizerConfig
from schemas.train import PPOConfig

Id = Annotated[str, Field(pattern=ID_PATTERN)]


def _dataset_id(value: str) -> str:
    """A dataset is named by its id in the tenant's namespace, never by a path on the
    services' disks (DESIGN.md §5)."""
    try:
        return validate_id(value, "dataset id")
    except InvalidIdError:
        looks_like_path = "/" in value or "\\" in value or value.startswith(".")
        raise ValueError(
            f"{value!r} is not a dataset id"
            + (" (paths are not accepted)" if looks_like_path else "")
            + ": name a dataset of your namespace (lowercase letters, digits and '-'); push "
            "it with `joynexus data push DIR --tenant T` or ask the operator to register it"
        ) from None


#: A dataset id in the job's tenant's namespace (see :mod:`bus.datasets`).
DatasetId = Annotated[str, AfterValidator(_dataset_id)]

#: Seeds are unsigned 32-bit, what every seeded library here takes (numpy's ``RandomState``,
#: under ManiSkill's episode seeds, takes no more).
MAX_SEED = 2**32 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, description="Random seed (0 to 2**32 - 1).")]
#: The bound of every count a spec gives (steps, intervals, sizes, versions): far above any
#: real run, and far inside the 64-bit integers the bus's msgpack carries (a larger int
#: passed validation and then failed the master's publish, naming no field).
MAX_COUNT = 10**9
_INT64 = (-(2**63), 2**63 - 1)


def _int64_values(kwargs: Any) -> Any:
    if isinstance(kwargs, dict):
        for key, value in kwargs.items():
            if isinstance(value, int) and not isinstance(value, bool):
                if not _INT64[0] <= value <= _INT64[1]:
                    raise ValueError(
                        f"{key!r}: {value} is outside the 64-bit integers an env argument can carry"
                    )
    return kwargs


#: An env's constructor arguments; an int must fit 64 bits (checked before the union below
#: could turn a larger one into a float).
EnvKwargs = Annotated[dict[str, float | int | str | bool], BeforeValidator(_int64_values)]


class JobSpecError(ValueError):
    """A job spec that cannot be accepted; the message names each bad field."""


class _Strict(BaseModel):
    # No inf or NaN anywhere in a spec: a bound like ``ge=0`` lets inf through.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class HeadSpec(_Strict):
    """The tenant's action module."""

    kind: Literal["oft", "discrete", "flow"] = Field(description="Head architecture.")
    action_dim: int | None = Field(
        None, ge=1, le=64, description="Dimension of one action vector (omitted: the env's)."
    )
    chunk_len: int = Field(1, ge=1, le=64, description="Actions predicted per step.")
    proprio_dim: int | None = Field(
        None, ge=0, le=256, description="Proprio state dim: omitted, the env's; 0: none."
    )
    hidden_dim: int = Field(64, ge=8, le=4096)
    num_layers: int = Field(1, ge=1, le=16)
    num_bins: int = Field(32, ge=2, le=1024, description="Discrete head: bins per dim.")
    flow_steps: int = Field(8, ge=1, le=128, description="Flow head: Euler steps.")
    value_head: bool = False
    vision: bool = Field(
        True, description="False: a blind policy on proprio alone (a baseline for vision)."
    )

    def filled(self, action_dim: int, proprio_dim: int, source: str = "env") -> HeadSpec:
        """This head with its omitted dims taken from the env (or dataset) it trains on,
        within the head's own bounds (:class:`JobSpecError` naming the dim and ``source``
        otherwise)."""
        values = self.model_dump()
        taken = []
        for name, value in (("action_dim", action_dim), ("proprio_dim", proprio_dim)):
            if values[name] is None:
                values[name] = value
                taken.append(name)
        try:
            return HeadSpec.model_validate(values)
        except ValidationError as exc:
            raise JobSpecError(
                f"{format_validation_error(exc, 'head.')} (omitted in the spec, so the "
                f"{source}'s {' and '.join(taken)} was taken)"
            ) from exc

    def to_config(self) -> HeadConfig:
        """The model-facing config; the master fills omitted dims (:meth:`filled`) first."""
        if self.action_dim is None or self.proprio_dim is None:
            raise ValueError("head.action_dim / head.proprio_dim must be filled in from the env")
        return HeadConfig(**self.model_dump())


class OptimizerSpec(_Strict):
    """AdamW with optional warmup and cosine decay."""

    lr: float = Field(1e-3, gt=0, le=1.0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9,
        0.999,
    )
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="Max grad norm; 0 disables.")
    warmup_steps: int = Field(0, ge=0, le=MAX_COUNT)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)

    def to_config(self, total_steps: int) -> OptimizerConfig:
        return OptimizerConfig(
            lr=self.lr,
            betas=self.betas,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
            warmup_steps=self.warmup_steps,
            total_steps=total_steps if self.schedule == "cosine" else 0,
            min_lr_ratio=self.min_lr_ratio,
        )


class SFTJobSpec(_Strict):
    """Supervised fine-tuning of a tenant's action module on an offline dataset."""

    kind: Literal["sft"]
    tenant: Id
    backbone: Id = Field("tiny", description="Backbone id served by a trainer.")
    dataset: DatasetId = Field(
        description="Id of a dataset in the tenant's namespace (pushed or registered)."
    )
    head: HeadSpec
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    batch_size: int = Field(8, ge=1, le=4096)
    steps: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Optimizer steps (or use epochs)."
    )
    epochs: int | None = Field(None, ge=1, le=MAX_COUNT, description="Passes over the train split.")
    val_fraction: float = Field(0.0, ge=0, lt=1)
    seed: Seed = 0
    num_views: int = Field(1, ge=1, le=3)
    token_budget: int = Field(48, ge=8, le=4096, description="Text+image tokens per sample.")
    #: Commit a checkpoint (policy version) every this many steps (the last step always).
    checkpoint_every: int = Field(10, ge=1, le=MAX_COUNT)
    priority: int = Field(1, ge=1, le=16, description="Fair-share weight on the trainer.")
    init_from: Id | None = Field(None, description="Job id of this tenant to start from.")

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> SFTJobSpec:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of 'steps' or 'epochs'")
        return self


class PPOSpec(_Strict):
    """RL algorithm settings (PPO, or GRPO's group-relative advantages without a critic)."""

    algorithm: Literal["ppo", "grpo"] = "ppo"
    gamma: float = Field(0.99, gt=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    clip: float = Field(0.2, gt=0, le=1)
    epochs: int = Field(4, ge=1, le=100)
    minibatch_size: int = Field(64, ge=1, le=MAX_COUNT)
    value_coef: float = Field(0.5, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    max_policy_lag: int = Field(0, ge=0, le=16, description="Rollouts may lag this many versions.")
    normalize_advantages: bool = True

    def to_config(self, episodes_per_iteration: int) -> PPOConfig:
        return PPOConfig(episodes_per_iteration=episodes_per_iteration, **self.model_dump())


class RLJobSpec(_Strict):
    """Reinforcement learning of a tenant's action module in a simulator."""

    kind: Literal["rl"]
    tenant: Id
    backbone: Id = "tiny"
    env: str = Field(min_length=1, description="Env id (JoyNexus/*, ManiSkill task, gym id).")
    env_kwargs: EnvKwargs = Field(
        default_factory=dict, description="Constructor arguments of the env."
    )
    head: HeadSpec
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    rl: PPOSpec = Field(default_factory=PPOSpec)
    iterations: int = Field(ge=1, le=100_000, description="Updates (= policy versions).")
    episodes_per_iteration: int = Field(8, ge=1, le=4096)
    parallel_envs: int = Field(4, ge=1, le=256, description="Sessions per rollout task.")
    max_episode_steps: int = Field(50, ge=1, le=10_000)
    image_size: int = Field(64, ge=8, le=1024)
    num_views: int = Field(1, ge=1, le=3)
    token_budget: int = Field(16, ge=4, le=4096)
    seed: Seed = 0
    priority: int = Field(1, ge=1, le=16)
    init_from: Id | None = Field(None, description="Job id of this tenant to start from.")

    @model_validator(mode="after")
    def _critic(self) -> RLJobSpec:
        if self.rl.algorithm == "ppo" and not self.head.value_head:
            raise ValueError(
                "head.value_head: PPO needs a value head (set it true, or use rl.algorithm: grpo)"
            )
        return self


class EvalJobSpec(_Strict):
    """Read-only evaluation of a fixed policy version, in an env or on a held-out dataset."""

    kind: Literal["eval"]
    tenant: Id
    backbone: Id = "tiny"
    policy_job: Id = Field(description="Job id (of this tenant) whose policy is evaluated.")
    policy_version: int = Field(0, ge=0, le=MAX_COUNT, description="0 = the latest at submit time.")
    env: str | None = None
    env_kwargs: EnvKwargs = Field(default_factory=dict)
    dataset: DatasetId | None = Field(
        None, description="Id of a dataset in the tenant's namespace (held-out episodes)."
    )
    episodes: int = Field(16, ge=1, le=100_000)
    max_episode_steps: int = Field(50, ge=1, le=10_000)
    image_size: int = Field(64, ge=8, le=1024)
    parallel_envs: int = Field(4, ge=1, le=256)
    val_fraction: float = Field(0.2, gt=0, lt=1, description="Held-out episodes (dataset).")
    seed: Seed = 10_000

    @model_validator(mode="after")
    def _target(self) -> EvalJobSpec:
        if (self.env is None) == (self.dataset is None):
            raise ValueError("give exactly one of 'env' or 'dataset'")
        return self


class PipelineSpec(_Strict):
    """Stages run one after another; each stage after the first starts from the previous
    training stage's policy (``init_from`` / ``policy_job`` are filled in)."""

    kind: Literal["pipeline"]
    tenant: Id
    stages: list[Annotated[SFTJobSpec | RLJobSpec | EvalJobSpec, Field(discriminator="kind")]] = (
        Field(min_length=1, max_length=16)
    )

    @model_validator(mode="after")
    def _one_tenant(self) -> PipelineSpec:
        for i, stage in enumerate(self.stages):
            if stage.tenant != self.tenant:
                raise ValueError(f"stages.{i}.tenant: {stage.tenant!r} is not {self.tenant!r}")
            if stage.backbone != self.stages[0].backbone:
                # Each stage starts from the policy of the one before: one backbone for all.
                raise ValueError(
                    f"stages.{i}.backbone: {stage.backbone!r} is not stage 0's "
                    f"{self.stages[0].backbone!r}"
                )
        if isinstance(self.stages[0], EvalJobSpec):
            raise ValueError("stages.0: a pipeline starts with a training stage")
        return self


class SessionSpec(_Strict):
    """A low-level training session: a slot on the trainer that the tenant's own algorithm
    drives call by call (``forward_backward``, ``optim_step``, ``save_state``, ...: see
    :mod:`clients.lowlevel`) instead of a dataset or an env."""

    kind: Literal["session"]
    tenant: Id
    backbone: Id = "tiny"
    head: HeadSpec
    optimizer: OptimizerSpec = Field(
        default_factory=OptimizerSpec,
        description="AdamW's defaults; each optim_step call gives its own hyper-parameters.",
    )
    seed: Seed = 0
    num_views: int = Field(1, ge=1, le=3)
    token_budget: int = Field(16, ge=4, le=4096, description="Text+image tokens per sample.")
    #: Commit a checkpoint at least every this many calls (and on every save_state).
    checkpoint_every: int = Field(20, ge=1, le=MAX_COUNT)
    priority: int = Field(1, ge=1, le=16, description="Fair-share weight on the trainer.")
    lease_s: float = Field(
        300.0,
        ge=2.0,
        le=7 * 86400.0,
        description="The session is closed when its client sends nothing for this long.",
    )
    max_calls: int = Field(1_000_000, ge=1, le=100_000_000)
    init_from: Id | None = Field(None, description="Job id of this tenant to start from.")

    @model_validator(mode="after")
    def _dims(self) -> SessionSpec:
        for name in ("action_dim", "proprio_dim"):
            if getattr(self.head, name) is None:
                raise ValueError(f"head.{name}: a session has no env to take it from; give it")
        return self


JobSpec = SFTJobSpec | RLJobSpec | EvalJobSpec | PipelineSpec | SessionSpec
_SPEC_KINDS: dict[str, type[BaseModel]] = {
    "sft": SFTJobSpec,
    "rl": RLJobSpec,
    "eval": EvalJobSpec,
    "pipeline": PipelineSpec,
    "session": SessionSpec,
}


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """``field.path: message`` lines, one per problem (each path after ``prefix``)."""
    lines = []
    for item in error.errors():
        path = prefix + ".".join(str(p) for p in item["loc"])
        msg = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
        msg = msg.removeprefix("Value error, ")  # whole-spec checks name their fields
        lines.append(f"{path}: {msg}" if path else msg)
    return "; ".join(lines)


def parse_job_spec(document: Any) -> JobSpec:
    """Validate a spec given as a mapping, JSON text or bytes; raise :class:`JobSpecError`."""
    if isinstance(document, bytes | str):
        try:
            document = json.loads(document)
        except json.JSONDecodeError as exc:
            raise JobSpecError(f"spec is not valid JSON: {exc}") from exc
        except UnicodeDecodeError as exc:  # bytes that are no text at all
            raise JobSpecError(f"spec is not UTF-8 JSON text: {exc}") from exc
    if not isinstance(document, dict):
        raise JobSpecError(f"spec must be a mapping, got {type(document).__name__}")
    kind = document.get("kind")
    model = _SPEC_KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise JobSpecError(
            f"kind: unknown job kind {kind!r}; expected one of {sorted(_SPEC_KINDS)}"
        )
    try:
        return model.model_validate(document)  # type: ignore[return-value]
    except ValidationError as exc:
        raise JobSpecError(format_validation_error(exc)) from exc
