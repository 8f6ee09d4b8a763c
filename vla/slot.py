"""Tenant slots: one tenant's trainable state, isolated from every other tenant's.

A :class:`TenantSlot` holds an action module, its AdamW optimizer, the learning-rate schedule,
the tenant's own ``torch.Generator``, a step counter and the policy version. Everything a step
draws at random comes from the slot's generator, so a tenant's trajectory depends only on its
own data and seed — not on which other tenants were grouped with it or in what order.

A slot serialises to bytes (:meth:`TenantSlot.to_bytes`) for the object store; restoring
continues bit-exactly. :class:`SlotManager` keeps the resident slots within a memory budget by
evicting the least recently used ones to bytes and restoring them on demand.
"""

from __future__ import annotations

import io
import math
from collections import OrderedDict
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from schemas.model import HeadConfig, OptimizerConfig
from vla.feature import VLAFeature
from vla.flatparams import flatten_parameters, register_flat
from vla.heads import ActionHead, ActOutput, build_head

#: Version of the layout written by :meth:`TenantSlot.state_dict`; bump on incompatible change.
_STATE_FORMAT = 1


class NonFiniteLossError(FloatingPointError):
    """A tenant's step produced a NaN/inf loss or gradient; the update was not applied.

    The slot is left exactly as before the step (parameters, optimizer state, RNG, step
    counter), so the tenant can drop the bad batch and carry on.
    """

    def __init__(self, tenant: str, step: int, what: str, value: float) -> None:
        super().__init__(
            f"tenant {tenant!r} step {step}: non-finite {what} ({value}); update not applied"
        )
        self.tenant = tenant
        self.step = step
        self.what = what
        self.value = value


@dataclass(frozen=True)
class StepResult:
    """Outcome of one applied optimizer step.

    ``loss``: the batch loss before the update. ``grad_norm``: global grad norm before
    clipping. ``lr``: the learning rate used. ``step``: the slot's step count after the update.
    """

    loss: float
    grad_norm: float
    lr: float
    step: int


def lr_at(config: OptimizerConfig, step: int) -> float:
    """Learning rate for the update that follows ``step`` completed updates.

    Linear warmup over ``warmup_steps`` (first update at ``lr / warmup_steps``), then cosine
    decay to ``min_lr_ratio * lr`` over ``total_steps - warmup_steps`` updates (constant after
    warmup when ``total_steps`` is 0). A pure function of the step, so the schedule needs no
    state of its own beyond the slot's step counter.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.total_steps <= 0:
        return config.lr
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def _copied(value: Any) -> Any:
    """``value`` (a state dict's tree of dicts, lists and tensors) with every tensor copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copied(v) for v in value)
    return value


def state_bytes(state: dict[str, Any]) -> bytes:
    """A :meth:`TenantSlot.state_dict` serialised as :meth:`TenantSlot.to_bytes` does."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _fields(config: HeadConfig | OptimizerConfig) -> dict[str, Any]:
    """A config Struct as a dict of primitives (str, int, float, bool, tuple), which
    ``torch.load(weights_only=True)`` reads back; ``Config(**d)`` rebuilds and re-validates."""
    return {name: getattr(config, name) for name in config.__struct_fields__}


def _generator_for(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device)


class TenantSlot:
    """One tenant's action module, optimizer, schedule, RNG, step counter and policy version.

    Args:
        tenant: the tenant id (used in errors and by :class:`SlotManager`).
        head: what to build (see :func:`vla.heads.build_head`).
        optim: AdamW hyper-parameters, clipping and schedule.
        hidden_size: the backbone's hidden size.
        seed: seeds both the module's initial weights and the slot's generator.
        device: where the module and generator live.
    """

    def __init__(
        self,
        tenant: str,
        head: HeadConfig,
        optim: OptimizerConfig,
        hidden_size: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.tenant = tenant
        self.head_config = head
        self.optim_config = optim
        self.hidden_size = hidden_size
        self.seed = seed
        self.device = torch.device(device)
        # Initialise under a forked, seeded global RNG: weights depend on the seed only, and
        # the process-wide RNG other code relies on is left untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.module: ActionHead = build_head(head, hidden_size).to(self.device)
        # One flat tensor under the parameters: the shared AdamW step then updates this
        # tenant with a few kernels instead of a few per parameter tensor (vla.multiopt).
        flat = flatten_parameters(self.module)
        self.generator = _generator_for(self.device)
        self.generator.manual_seed(seed)
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            # One fused pass over all parameter tensors instead of a Python loop per tensor:
            # the head's tensors are many and small, so per-tensor overhead dominates on CPU.
            foreach=True,
        )
        if flat is not None:
            register_flat(self.optimizer, flat)
        self.step = 0
        self.version = 0

    # -- training ---------------------------------------------------------------------------
    def train_step(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> StepResult:
        """One supervised update: zero grads, loss, backward, clip, AdamW step, schedule.

        Runs as a stack of one through :func:`vla.batched.train_steps`, the same kernels a
        step batched with other tenants runs, so a tenant's trajectory is the same bits
        alone or grouped. Raises ``ValueError`` for mis-shaped inputs and
        :class:`NonFiniteLossError` for a NaN/inf loss or gradient; in both cases, and for
        any other exception raised before the optimizer step, nothing in the slot changes.
        """
        from vla.batched import train_steps  # vla.batched builds on this module

        (result,) = train_steps([self], [feature], [actions_B_C_A])
        if isinstance(result, Exception):
            raise result
        return result

    def params(self) -> list[torch.Tensor]:
        """The parameters in module order: the optimizer's one param group (a list already,
        where walking the module is not free), as the constructor builds it."""
        groups = self.optimizer.param_groups
        return groups[0]["params"] if len(groups) == 1 else list(self.module.parameters())

    def drop_grads(self) -> None:
        """``optimizer.zero_grad(set_to_none=True)`` without its per-call overhead (a profiler
        span and a walk of the param groups), several times a step for every tenant."""
        for p in self.params():
            p.grad = None

    def has_grads(self) -> bool:
        """Whether the slot holds accumulated gradients (a low-level session between calls)."""
        return any(p.grad is not None for p in self.params())

    @torch.no_grad()
    def act(self, feature: VLAFeature, deterministic: bool = False) -> ActOutput:
        """The policy's actions for ``feature``, sampled with the slot's own generator."""
        self.module.eval()
        return self.module.act(feature, generator=self.generator, deterministic=deterministic)

    def publish_version(self) -> int:
        """Mark the current weights as a new policy version and return its number."""
        self.version += 1
        return self.version

    # -- memory -----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Resident footprint in bytes: parameters + gradients + AdamW state.

        Computed from the parameters rather than measured, so it is the same before the first
        step (when grads and moments are not yet allocated) as at the steady-state peak of a
        step: per parameter tensor its bytes four times (weights, grad, ``exp_avg``,
        ``exp_avg_sq``) plus AdamW's float32 ``step`` scalar. A test checks it against the
        measured tensors after a step.
        """
        total = 0
        for p in self.module.parameters():
            total += 4 * p.numel() * p.element_size() + 4
        return total

    # -- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild and continue this slot bit-exactly.

        Contains only tensors and primitives (``torch.load(weights_only=True)`` reads it):
        configs as builtins, module and optimizer state, the generator state (a uint8 tensor),
        step, version and any accumulated gradients. The LR schedule is a function of
        ``step`` and needs nothing else.
        """
        return {
            "format": _STATE_FORMAT,
            "tenant": self.tenant,
            "head": _fields(self.head_config),
            "optim": _fields(self.optim_config),
            "hidden_size": self.hidden_size,
            "seed": self.seed,
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": self.generator.get_state(),
            "step": self.step,
            "version": self.version,
            # A low-level session's gradients accumulated between forward_backward and
            # optim_step (empty between SFT steps, which free them).
            "grads": {
                name: p.grad.detach().clone()
                for name, p in self.module.named_parameters()
                if p.grad is not None
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore module, optimizer, RNG, step and version from :meth:`state_dict`."""
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unsupported slot state format {state.get('format')!r}")
        head = HeadConfig(**state["head"])
        if head != self.head_config or state["hidden_size"] != self.hidden_size:
            raise ValueError(
                f"slot state for {head} on hidden size {state['hidden_size']} does not fit "
                f"this slot ({self.head_config} on hidden size {self.hidden_size})"
            )
        # States written before the proprio statistics existed lack them: identity, as then.
        module_state = dict(state["module"])
        if self.head_config.proprio_dim and "proprio_mean_P" not in module_state:
            module_state["proprio_mean_P"] = torch.zeros(self.head_config.proprio_dim)
            module_state["proprio_std_P"] = torch.ones(self.head_config.proprio_dim)
        # Likewise states written before the action statistics.
        if "action_centre_A" not in module_state:
            module_state["action_centre_A"] = torch.zeros(self.head_config.action_dim)
            module_state["action_half_range_A"] = torch.ones(self.head_config.action_dim)
        self.module.load_state_dict(module_state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["rng"])
        self.step = int(state["step"])
        self.version = int(state["version"])
        grads = state.get("grads", {})  # absent in states written before sessions existed
        for name, p in self.module.named_parameters():
            p.grad = grads[name].to(p.device) if name in grads else None

    def snapshot(self) -> dict[str, Any]:
        """:meth:`state_dict` with every tensor copied: it stays as it is while training goes
        on, so it can be serialised (:func:`state_bytes`) in another thread."""
        return _copied(self.state_dict())

    def to_bytes(self) -> bytes:
        """Serialise for the object store (``torch.save``; loadable with ``weights_only``)."""
        return state_bytes(self.state_dict())

    @classmethod
    def from_bytes(cls, data: bytes, device: torch.device | str = "cpu") -> TenantSlot:
        """Rebuild a slot saved by :meth:`to_bytes` (no code is unpickled)."""
        state = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
        slot = cls(
            tenant=state["tenant"],
            head=HeadConfig(**state["head"]),
            optim=OptimizerConfig(**state["optim"]),
            hidden_size=int(state["hidden_size"]),
            seed=int(state["seed"]),
            device=device,
        )
        # A CUDA generator's state is a CPU tensor; map_location must not have moved it.
        state["rng"] = state["rng"].cpu()
        slot.load_state_dict(state)
        return slot


class SlotBudgetError(MemoryError):
    """The requested slots do not fit in the manager's memory budget even after eviction."""


class SlotManager:
    """Resident tenant slots under a memory budget, evicting least recently used to bytes.

    ``store`` stands for the object store: evicted slots are kept there as
    :meth:`TenantSlot.to_bytes` blobs, keyed by tenant, and restored on the next
    :meth:`get`/:meth:`acquire`. The sum of resident :attr:`TenantSlot.nbytes` never exceeds
    ``budget_bytes``.
    """

    def __init__(
        self,
        budget_bytes: int,
        store: MutableMapping[str, bytes] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.store: MutableMapping[str, bytes] = {} if store is None else store
        self.device = torch.device(device)
        # Insertion order is recency order: the first entry is the least recently used.
        self._resident: OrderedDict[str, TenantSlot] = OrderedDict()
        # Footprints of evicted slots (nbytes is fixed by the head config).
        self._sizes: dict[str, int] = {}

    @property
    def resident(self) -> list[str]:
        """Tenants whose slots are in memory, least recently used first."""
        return list(self._resident)

    @property
    def resident_bytes(self) -> int:
        """Sum of the resident slots' footprints."""
        return sum(s.nbytes for s in self._resident.values())

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._resident or tenant in self.store

    def footprint(self, tenant: str) -> int:
        """Bytes the tenant's slot takes when resident (whether it is resident now or not)."""
        if tenant in self._resident:
            return self._resident[tenant].nbytes
        if tenant not in self._sizes:
            self._sizes[tenant] = TenantSlot.from_bytes(self.store[tenant], self.device).nbytes
        return self._sizes[tenant]

    def create(
        self,
        tenant: str,
        head: HeadConfig,
        optim: OptimizerConfig,
        hidden_size: int,
        seed: int = 0,
    ) -> TenantSlot:
        """Create a new resident slot for ``tenant``, evicting others as needed."""
        if tenant in self:
            raise ValueError(f"tenant {tenant!r} already has a slot")
        slot = TenantSlot(tenant, head, optim, hidden_size, seed=seed, device=self.device)
        self._make_room(slot.nbytes, keep={tenant})
        self._resident[tenant] = slot
        return slot

    def get(self, tenant: str) -> TenantSlot:
        """The tenant's slot, restored from the store if it was evicted; marks it recent."""
        return self.acquire([tenant])[0]

    def acquire(self, tenants: Iterable[str]) -> list[TenantSlot]:
        """Make all ``tenants`` resident at once (e.g. one training group) and return them.

        Only slots outside the set are evicted, so no member of the group evicts another.
        Raises :class:`SlotBudgetError` when the set alone exceeds the budget and ``KeyError``
        for an unknown tenant.
        """
        wanted = list(dict.fromkeys(tenants))
        for t in wanted:
            if t not in self:
                raise KeyError(f"no slot for tenant {t!r}")
        missing = [t for t in wanted if t not in self._resident]
        # Make room before deserialising, using sizes recorded at eviction; a blob this
        # manager never saw (a store that outlived a process) is decoded first to learn it.
        restored = {
            t: TenantSlot.from_bytes(self.store[t], self.device)
            for t in missing
            if t not in self._sizes
        }
        need = sum(self._sizes[t] if t in self._sizes else restored[t].nbytes for t in missing)
        self._make_room(need, keep=set(wanted))
        for t in missing:
            slot = (
                restored[t] if t in restored else TenantSlot.from_bytes(self.store[t], self.device)
            )
            self._resident[t] = slot
            del self.store[t]
        for t in wanted:
            self._resident.move_to_end(t)
        return [self._resident[t] for t in wanted]

    def evict(self, tenant: str) -> bytes:
        """Serialise the tenant's resident slot to the store and drop it from memory."""
        slot = self._resident.pop(tenant)
        data = slot.to_bytes()
        self.store[tenant] = data
        self._sizes[tenant] = slot.nbytes
        return data

    def remove(self, tenant: str) -> None:
        """Forget the tenant's slot entirely (resident or stored)."""
        self._resident.pop(tenant, None)
        self.store.pop(tenant, None)
        self._sizes.pop(tenant, None)

    def _make_room(self, need: int, keep: set[str]) -> None:
        kept = sum(s.nbytes for t, s in self._resident.items() if t in keep)
        if need + kept > self.budget_bytes:
            raise SlotBudgetError(
                f"{need + kept} bytes of slots for {sorted(keep)} exceed the budget of "
                f"{self.budget_bytes} bytes"
            )
        while self.resident_bytes + need > self.budget_bytes:
            victim = next(t for t in self._resident if t not in keep)
            self.evict(victim)
