"""Slot lifecycle on the trainer: create, restore from a checkpoint, acquire for a round, and
remove — under the memory budget, with every budget failure turned into the job's own error
(a slot that can never fit fails its job; the trainer goes on serving everyone else)."""

from __future__ import annotations

from schemas.train import OpenSlot
from services.trainer.jobs import JobError
from vla.backbone import Backbone
from vla.normalize import Normaliser, Normalisers
from vla.slot import SlotBudgetError, SlotManager, TenantSlot


class Slots:
    """The trainer's resident slots and the normalisers their jobs share."""

    def __init__(self, backbone: Backbone, budget_bytes: int, device: str) -> None:
        self.backbone = backbone
        self.manager = SlotManager(budget_bytes, device=device)
        self._normalisers = Normalisers(backbone)

    @property
    def budget_bytes(self) -> int:
        return self.manager.budget_bytes

    @property
    def resident_bytes(self) -> int:
        return self.manager.resident_bytes

    def normaliser(self, num_views: int, token_budget: int) -> Normaliser:
        return self._normalisers.get(num_views, token_budget)

    def create(self, key: str, spec: OpenSlot, init_module: bytes | None = None) -> TenantSlot:
        """A new slot for the job ``spec`` opens, optionally with another checkpoint's module
        weights. Raises :class:`JobError` if the head is invalid or cannot fit the budget."""
        try:
            slot = self.manager.create(
                key, spec.head, spec.optimizer, self.backbone.hidden_size, seed=spec.seed
            )
        except SlotBudgetError as exc:
            raise JobError(f"cannot open slot: {exc}", spec.job_id) from exc
        except (ValueError, MemoryError) as exc:
            raise JobError(f"cannot open slot: {exc}", spec.job_id) from exc
        if init_module is not None:
            try:
                source = TenantSlot.from_bytes(init_module)
                slot.module.load_state_dict(source.module.state_dict())
            except (RuntimeError, ValueError, KeyError) as exc:
                self.manager.remove(key)
                raise JobError(f"cannot initialise the slot: {exc}", spec.job_id) from exc
        try:
            if spec.proprio_mean or spec.proprio_std:
                slot.module.set_proprio_stats(spec.proprio_mean, spec.proprio_std)
            if spec.action_min or spec.action_max:
                slot.module.set_action_stats(spec.action_min, spec.action_max)
        except ValueError as exc:
            self.manager.remove(key)
            raise JobError(f"cannot open slot: {exc}", spec.job_id) from exc
        return slot

    def restore(self, key: str, job_id: str, checkpoint: bytes) -> TenantSlot:
        """The job's slot from its latest checkpoint (made resident)."""
        self.manager.store[key] = checkpoint
        try:
            return self.manager.get(key)
        except SlotBudgetError as exc:
            self.manager.remove(key)
            raise JobError(f"cannot restore slot: {exc}", job_id) from exc

    def footprint(self, key: str) -> int:
        return self.manager.footprint(key)

    def fits(self, keys: list[str]) -> list[str]:
        """The longest prefix of ``keys`` whose slots fit the budget together."""
        chosen, used = [], 0
        for key in keys:
            need = self.footprint(key)
            if used + need > self.budget_bytes:
                break
            chosen.append(key)
            used += need
        return chosen

    def acquire(self, keys: list[str]) -> list[TenantSlot]:
        """Make ``keys``' slots resident together (the caller chose a set that fits)."""
        return self.manager.acquire(keys)

    def remove(self, key: str) -> None:
        if key in self.manager:
            self.manager.remove(key)
