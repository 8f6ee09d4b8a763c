"""Low-level sessions on the trainer: a tenant's own algorithm drives its slot call by call.

A session is a job whose :class:`~schemas.train.OpenSlot` has ``session`` set; its TRAIN
messages are :data:`~schemas.train.SessionCall` s, numbered from 0 by the client and applied
strictly in that order, each once (the same ledger rule as SFT steps:
:func:`~services.trainer.ledger.sft_verdict` on ``call``), so a call's effect never depends on
delivery order, redeliveries or a trainer restart.

* ``forward_backward`` / ``forward`` go into the round's ONE grouped backbone forward beside
  other tenants' SFT batches (:meth:`services.trainer.steps.Stepper.step`), their heads
  stacked with same-architecture heads; gradients accumulate in the slot, which a checkpoint
  carries (:meth:`vla.slot.TenantSlot.state_dict`).
* ``optim_step``, ``save_state`` and ``load_state`` need no backbone and are applied when
  triage reaches them (:func:`apply_now`).

Every call is answered by a :class:`~schemas.events.CallResult` event, published before the
call can be acked (:meth:`services.trainer.commit.Committer.publish_results`); a call that
cannot be applied (bad shapes, NaN loss, an unknown state name) is answered with its error and
still counts as done: the session goes on.
"""

from __future__ import annotations

import math
import re
import time

from bus import checkpoints as ckpt
from schemas.events import CallResult
from schemas.train import ForwardBackward, LoadState, OptimStep, SaveState, SessionCall
from services.trainer.jobs import JobSlot
from services.trainer.registry import JobRegistry
from services.trainer.sft import build_request
from services.trainer.slots import Slots
from vla.batched import PolicyGradient
from vla.grouping import TrainRequest
from vla.optimsteps import AdamParams, optim_steps
from vla.slot import NonFiniteLossError, StepResult, TenantSlot


def op_of(call: SessionCall) -> str:
    return str(type(call).__struct_config__.tag)


def result(
    job: JobSlot,
    call: SessionCall,
    metrics: dict[str, float] | None = None,
    *,
    version: int = 0,
    error: str = "",
) -> CallResult:
    spec = job.spec
    return CallResult(
        spec.tenant,
        spec.job_id,
        call.call,
        op_of(call),
        dict(metrics or {}),
        time.time(),
        version=version,
        error=error,
    )


def build_call_request(job: JobSlot, call: ForwardBackward) -> TrainRequest:
    """The call (already checked: :func:`services.trainer.checks.check_call`) as model inputs
    for the session's slot, stopping after the backward (or the loss, for a forward);
    :class:`ValueError` names a field that does not fit the session's head or loss."""
    request = build_request(job, call)
    request.mode = "accumulate" if call.backward else "forward"
    if call.loss_fn == "ppo":
        if call.advantages is None:
            raise ValueError("advantages: loss_fn 'ppo' needs per-sample advantages (B,)")
        old = call.old_log_probs
        request.objective = PolicyGradient(
            call.advantages.to_torch(), None if old is None else old.to_torch(), call.clip
        )
    return request


def forward_result(
    job: JobSlot, call: ForwardBackward, outcome: StepResult | Exception, group_size: int = 1
) -> CallResult:
    """The answer to a forward(-backward) the grouped step ran (or failed); ``group_size``:
    the batches (of any tenant) its backbone forward took."""
    if isinstance(outcome, NonFiniteLossError):
        return result(job, call, error=f"call {call.call}: {outcome}; nothing was accumulated")
    if isinstance(outcome, Exception):
        return result(job, call, error=f"call {call.call} failed: {outcome}")
    samples = float(call.actions.shape[0])
    return result(
        job, call, {"loss": outcome.loss, "samples": samples, "group_size": float(group_size)}
    )


async def apply_now(
    registry: JobRegistry, slots: Slots, job: JobSlot, call: OptimStep | SaveState | LoadState
) -> CallResult | None:
    """Apply a call that needs no backbone to the session's slot (made resident). Returns
    its answer, or None for a ``save_state``, which the commit it asks for answers (with the
    version). The call is counted as done either way, a state that is gone or damaged
    answered as such, except when the broker does not answer (``NatsError`` /
    ``TimeoutError`` are raised with nothing changed: triage tries the call again next
    round)."""
    state: bytes | None = None
    damage = ""
    if isinstance(call, LoadState) and call.name in job.saved:
        try:
            state = await _read_state(registry, job.saved[call.name])
        except ckpt.CheckpointError as exc:  # rereading next round would find it as damaged
            damage = str(exc)
    job.slot = slots.acquire([job.key])[0]
    job.batches_done = call.call + 1
    match call:
        case OptimStep():
            params = AdamParams(
                call.learning_rate,
                call.beta1,
                call.beta2,
                call.eps,
                call.weight_decay,
                call.grad_clip,
            )
            problem = _adam_problem(params)
            if problem:
                return result(job, call, error=problem)
            (outcome,) = optim_steps([job.slot], [params])
            if isinstance(outcome, Exception):
                return result(job, call, error=f"call {call.call}: {outcome}")
            metrics = {
                "grad_norm": outcome.grad_norm,
                "learning_rate": outcome.lr,
                "step": float(outcome.step),
            }
            return result(job, call, metrics)
        case SaveState():
            problem = _name_problem(call.name, job)
            if problem:
                return result(job, call, error=problem)
            job.save_as = (call.name, call.call)
            return None
        case LoadState():
            name = job.saved.get(call.name)
            if name is None:
                known = ", ".join(sorted(job.saved)) or "none"
                return result(
                    job, call, error=f"name: no state {call.name!r} was saved (saved: {known})"
                )
            if damage:
                return result(job, call, error=f"state {call.name!r} does not load: {damage}")
            if state is None:
                return result(job, call, error=f"state {call.name!r} ({name}) is gone")
            try:
                source = TenantSlot.from_bytes(state, job.slot.device)
                _load_into(job.slot, source, call.optimizer)
            except (RuntimeError, ValueError, KeyError) as exc:
                return result(job, call, error=f"state {call.name!r} does not load: {exc}")
            return result(job, call, {"step": float(job.slot.step)}, version=ckpt.version_of(name))


def saved_by(job: JobSlot, call: SaveState) -> bool:
    """Whether ``call`` is the one that saved its name (a record written before the calls
    were kept names none: then any call of the name is taken for it)."""
    return call.name in job.saved and job.saved_calls.get(call.name, call.call) == call.call


def saved_result(job: JobSlot, call: SaveState) -> CallResult:
    """The answer to a save already committed (a replayed call), from the session's record."""
    return result(job, call, version=ckpt.version_of(job.saved[call.name]))


#: Named states a session may keep (they outlive the version retention, in its record).
MAX_SAVED_STATES = 256


_STATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _name_problem(name: str, job: JobSlot) -> str:
    if not _STATE_NAME.fullmatch(name):
        return (
            f"name: {name[:80]!r} is not a state name (1 to 64 of A-Z, a-z, 0-9, '.', '_', "
            "'-', starting with a letter or digit)"
        )
    if name in job.saved:
        return f"name: state {name!r} is saved already"
    if len(job.saved) >= MAX_SAVED_STATES:
        return (
            f"name: the session keeps {MAX_SAVED_STATES} saved states already; start a new "
            "session from one (init_from) to keep saving"
        )
    return ""


def _adam_problem(p: AdamParams) -> str:
    if not all(
        math.isfinite(v)
        for v in (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip)
    ):
        return "AdamParams: every value must be finite"
    if not 0.0 <= p.learning_rate <= 10.0:
        return f"learning_rate: {p.learning_rate} is not in [0, 10]"
    for name, beta in (("beta1", p.beta1), ("beta2", p.beta2)):
        if not 0.0 <= beta < 1.0:
            return f"{name}: {beta} is not in [0, 1)"
    if not p.eps > 0.0:
        return f"eps: {p.eps} must be > 0"
    if not (p.weight_decay >= 0.0 and p.grad_clip >= 0.0):
        return "weight_decay / grad_clip: must be >= 0"
    return ""


async def _read_state(registry: JobRegistry, object_name: str) -> bytes | None:
    return await ckpt.read_object(registry.store, object_name)


def _load_into(slot: TenantSlot, source: TenantSlot, optimizer: bool) -> None:
    """``slot`` takes ``source``'s weights (and optimizer state and step count); its own
    generator, version and nothing accumulated."""
    slot.module.load_state_dict(source.module.state_dict())
    if optimizer:
        slot.optimizer.load_state_dict(source.optimizer.state_dict())
        slot.step = source.step
    slot.optimizer.zero_grad(set_to_none=True)
