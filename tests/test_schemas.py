"""Schemas: tensors, ids, subjects, tagged unions, specs and golden encodings."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bus.codec import DecodeError, decode, encode
from schemas import subjects
from schemas.dead import DEAD_LETTER_DECODER
from schemas.env import ENV_DECODER, RolloutTask
from schemas.events import EVENT_DECODER, Accepted, Rejected, event_kind
from schemas.feature import FEATURE_DECODER
from schemas.health import HEARTBEAT_DECODER, Heartbeat
from schemas.ids import InvalidIdError, validate_id
from schemas.infer import ACT_REPLY_DECODER, INFER_DECODER, ActRequest
from schemas.jobs import JOB_COMMAND_DECODER, JOB_RECORD_DECODER, JobCancel, JobSubmit
from schemas.model import HeadConfig, Observation
from schemas.specs import MAX_COUNT, HeadSpec, JobSpecError, SFTJobSpec, parse_job_spec
from schemas.tensor import MAX_NDIM, SUPPORTED_DTYPES, Tensor, TensorError, check_finite
from schemas.train import POLICY_RECORD_DECODER, TRAIN_DECODER, OpenSlot, PolicyRecord
from tests.golden.regen import SAMPLES

GOLDEN = Path(__file__).parent / "golden"
DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    "job_submit": JOB_COMMAND_DECODER,
    "job_cancel": JOB_COMMAND_DECODER,
    "job_record": JOB_RECORD_DECODER,
    "event_accepted": EVENT_DECODER,
    "event_rejected": EVENT_DECODER,
    "event_state": EVENT_DECODER,
    "event_progress": EVENT_DECODER,
    "event_policy": EVENT_DECODER,
    "heartbeat": HEARTBEAT_DECODER,
    "dead_letter": DEAD_LETTER_DECODER,
    "tensor_f32": msgspec.msgpack.Decoder(Tensor),
    "head_config": msgspec.msgpack.Decoder(HeadConfig),
    "observation": msgspec.msgpack.Decoder(Observation),
    "open_slot": TRAIN_DECODER,
    "close_slot": TRAIN_DECODER,
    "sft_batch": TRAIN_DECODER,
    "rollout_batch": TRAIN_DECODER,
    "forward_backward": TRAIN_DECODER,
    "optim_step": TRAIN_DECODER,
    "save_state": TRAIN_DECODER,
    "load_state": TRAIN_DECODER,
    "event_call": EVENT_DECODER,
    "feature_record": FEATURE_DECODER,
    "feature_ref": FEATURE_DECODER,
    "policy_record": POLICY_RECORD_DECODER,
    "act_request": INFER_DECODER,
    "act_reply": ACT_REPLY_DECODER,
    "act_reply_error": ACT_REPLY_DECODER,
    "act_reply_retryable": ACT_REPLY_DECODER,
    "env_stream_dataset": ENV_DECODER,
    "env_rollout_task": ENV_DECODER,
    "env_eval_task": ENV_DECODER,
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_golden_sample_decodes_and_reencodes_identically(name: str) -> None:
    data = (GOLDEN / f"{name}.msgpack").read_bytes()
    assert decode(DECODERS[name], data) == SAMPLES[name]
    assert encode(SAMPLES[name]) == data, f"encoding of {name} changed: schema evolution broke"


def test_an_error_reply_written_before_retryable_decodes_as_a_refusal() -> None:
    old = (GOLDEN / "act_reply_error_before_retryable.msgpack").read_bytes()
    decoded = decode(ACT_REPLY_DECODER, old)
    assert decoded.error and decoded.retryable is False
    assert decoded == SAMPLES["act_reply_error"]


def test_an_act_request_written_before_expires_at_still_decodes_without_a_deadline() -> None:
    """Rolling upgrade: an older writer's request (no ``expires_at``) reads as no deadline."""
    old = (GOLDEN / "act_request_before_expires_at.msgpack").read_bytes()
    decoded = decode(DECODERS["act_request"], old)
    assert isinstance(decoded, ActRequest) and decoded.expires_at == 0.0
    assert decoded == SAMPLES["act_request"]  # the sample has no deadline either


def test_act_requests_and_rollout_tasks_written_before_priorities_decode_at_weight_1() -> None:
    """Rolling upgrade: an older writer's act request or rollout task (no ``priority``) is
    served at the fair share's weight."""
    request = decode(
        DECODERS["act_request"], (GOLDEN / "act_request_before_priority.msgpack").read_bytes()
    )
    assert isinstance(request, ActRequest) and request.priority == 1
    assert request == SAMPLES["act_request"]
    task = decode(
        DECODERS["env_rollout_task"],
        (GOLDEN / "env_rollout_task_before_priority.msgpack").read_bytes(),
    )
    assert isinstance(task, RolloutTask) and task.priority == 1
    assert task == SAMPLES["env_rollout_task"]


#: The sample record as written before a session's named states were kept: none saved.
UNSAVED_RECORD = msgspec.structs.replace(
    cast(PolicyRecord, SAMPLES["policy_record"]), saved={}, saved_calls={}
)


def test_records_written_before_sessions_still_decode_as_no_session() -> None:
    """Rolling upgrade: an OpenSlot without ``session`` is a job's slot, a policy record
    without ``saved`` has no named states."""
    old_open = decode(
        DECODERS["open_slot"], (GOLDEN / "open_slot_before_session.msgpack").read_bytes()
    )
    assert isinstance(old_open, OpenSlot) and old_open.session is False
    assert old_open == SAMPLES["open_slot"]
    old_record = decode(
        DECODERS["policy_record"], (GOLDEN / "policy_record_before_saved.msgpack").read_bytes()
    )
    assert isinstance(old_record, PolicyRecord) and old_record.saved == {}
    assert old_record == UNSAVED_RECORD


def test_a_policy_record_written_before_saved_calls_names_no_saving_call() -> None:
    """Rolling upgrade: a session's record from before ``saved_calls`` decodes with none (the
    trainer then answers any replayed save of a saved name with its version, as it did)."""
    old_record = decode(
        DECODERS["policy_record"],
        (GOLDEN / "policy_record_before_saved_calls.msgpack").read_bytes(),
    )
    assert isinstance(old_record, PolicyRecord) and old_record.saved_calls == {}
    assert old_record == UNSAVED_RECORD


def test_slots_written_before_proprio_statistics_and_vision_decode_as_before() -> None:
    """Rolling upgrade: an OpenSlot (alone or inside a policy record) without
    ``proprio_mean``/``proprio_std`` carries no statistics (the policy keeps raw proprio),
    and a head config without ``vision`` sees."""
    old_head = decode(
        msgspec.msgpack.Decoder(HeadConfig),
        (GOLDEN / "head_config_before_vision.msgpack").read_bytes(),
    )
    assert old_head == SAMPLES["head_config"] and old_head.vision is True
    old_open = decode(
        DECODERS["open_slot"],
        (GOLDEN / "open_slot_before_proprio_stats.msgpack").read_bytes(),
    )
    assert isinstance(old_open, OpenSlot)
    assert old_open.proprio_mean == () and old_open.proprio_std == ()
    assert old_open == SAMPLES["open_slot"]
    old_record = decode(
        DECODERS["policy_record"],
        (GOLDEN / "policy_record_before_proprio_stats.msgpack").read_bytes(),
    )
    assert old_record == UNSAVED_RECORD


def test_a_slot_opened_before_action_statistics_still_decodes_without_them() -> None:
    for name in ("open_slot", "policy_record"):
        old = decode(DECODERS[name], (GOLDEN / f"{name}_before_action_stats.msgpack").read_bytes())
        assert old == (UNSAVED_RECORD if name == "policy_record" else SAMPLES[name])
        slot = old if isinstance(old, OpenSlot) else old.slot  # type: ignore[attr-defined]
        assert slot.action_min == () and slot.action_max == ()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.array([[1, 2], [3, 4]], dtype=np.int64),
        np.zeros((0, 5), dtype=np.float16),
        np.array([True, False]),
        np.arange(12, dtype=np.uint8).reshape(2, 2, 3)[:, :, ::-1],  # non-contiguous
    ],
)
def test_tensor_round_trips_numpy_and_torch(array: np.ndarray) -> None:
    wire = decode(msgspec.msgpack.Decoder(Tensor), encode(Tensor.from_numpy(array)))
    np.testing.assert_array_equal(wire.to_numpy(), array)
    np.testing.assert_array_equal(wire.to_torch().numpy(), array)


def test_tensor_to_numpy_is_zero_copy() -> None:
    t = Tensor.from_numpy(np.arange(4, dtype=np.float32))
    view = t.to_numpy()
    assert np.shares_memory(view, np.frombuffer(t.data, dtype=np.uint8))


def test_bfloat16_is_bit_exact() -> None:
    x = torch.randn(3, 5).to(torch.bfloat16)
    back = Tensor.from_torch(x).to_torch()
    assert back.dtype == torch.bfloat16
    assert torch.equal(back, x)


def test_tensor_rejects_size_mismatch_and_bad_dtype() -> None:
    with pytest.raises(TensorError, match=r"needs 24 bytes, got 20"):
        Tensor("float32", (2, 3), b"\x00" * 20).to_numpy()
    with pytest.raises(TensorError, match="unsupported dtype 'complex64'"):
        Tensor("complex64", (1,), b"\x00" * 8).validate()
    with pytest.raises(TensorError, match="unsupported dtype"):
        Tensor.from_numpy(np.zeros(2, dtype=np.complex64))
    with pytest.raises(TensorError, match="invalid shape"):
        Tensor("float32", (-1, 2), b"").validate()


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [("float32", (4, 0, 2**63 - 1)), ("uint8", (0, 2**63)), ("float32", (0, 2**61))],
)
def test_an_empty_tensor_whose_dims_no_array_can_address_is_refused(
    dtype: str, shape: tuple[int, ...]
) -> None:
    """Found by an audit: with a zero dim the byte count matches (none), and numpy's reshape
    then raised a plain ValueError inside a role's finiteness check, which crashed the
    trainer on every start while the call was redelivered."""
    with pytest.raises(TensorError, match=r"non-zero dims span more bytes than an array"):
        Tensor(dtype, shape, b"").to_numpy()
    with pytest.raises(TensorError, match=r"33 dims, at most 32"):
        Tensor("uint8", (1,) * 32 + (0,), b"").validate()


@given(
    st.sampled_from(sorted(SUPPORTED_DTYPES)),
    st.lists(
        st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1), st.sampled_from([2**61, 2**62])),
        max_size=MAX_NDIM + 2,
    ),
)
def test_a_tensor_that_validates_converts(dtype: str, dims: list[int]) -> None:
    """Whatever shape a peer declares, a tensor is refused by ``validate`` (TensorError) or
    it converts: no other error reaches a role."""
    shape = tuple(dims)
    size = math.prod(shape)
    data = b"\x00" * (size * SUPPORTED_DTYPES[dtype]) if size <= 64 else b""
    tensor = Tensor(dtype, shape, data)
    try:
        tensor.validate()
    except TensorError:
        return
    assert tensor.to_numpy().shape == shape
    assert tuple(tensor.to_torch().shape) == shape
    check_finite(tensor, "x")


@pytest.mark.parametrize("good", ["a", "acme", "tenant-1", "0", "a" * 64])
def test_valid_ids(good: str) -> None:
    assert validate_id(good) == good


@pytest.mark.parametrize("bad", ["", "-a", "A", "a.b", "a*", "a>", "a b", "a" * 65, "é"])
def test_invalid_ids_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidIdError, match="invalid tenant"):
        validate_id(bad, "tenant")


@given(st.text(min_size=1, max_size=80))
def test_no_id_can_inject_subject_tokens(text: str) -> None:
    try:
        subject = subjects.train("tiny", text)
    except InvalidIdError:
        return
    assert subject.count(".") == 3 and "*" not in subject and ">" not in subject


def test_subject_builders() -> None:
    assert subjects.job("acme", "submit") == "nexus.job.acme.submit"
    assert subjects.train("tiny", "acme") == "nexus.train.tiny.acme"
    assert subjects.infer("tiny", "acme") == "nexus.infer.tiny.acme"
    assert subjects.env("acme", "j1") == "nexus.env.acme.j1"
    assert subjects.event("acme", "j1", "progress") == "nexus.event.acme.j1.progress"
    assert subjects.dead("JOBS", "acme") == "nexus.dead.jobs.acme"
    assert subjects.tenant_of("nexus.train.tiny.acme") == "acme"
    with pytest.raises(ValueError, match="unknown job verb"):
        subjects.job("acme", "explode")


def test_job_command_union_dispatches_on_tag() -> None:
    submit = decode(JOB_COMMAND_DECODER, encode(JobSubmit("a", "j", b"{}", 1.0)))
    cancel = decode(JOB_COMMAND_DECODER, encode(JobCancel("a", "j")))
    assert isinstance(submit, JobSubmit) and isinstance(cancel, JobCancel)
    assert event_kind(Accepted("a", "j", "sft", 1.0)) == "accepted"
    assert isinstance(decode(EVENT_DECODER, encode(Rejected("a", "j", "r", 1.0))), Rejected)


def test_wrong_types_are_rejected_and_unknown_fields_ignored() -> None:
    with pytest.raises(DecodeError, match="Expected `str`"):
        decode(
            JOB_COMMAND_DECODER,
            msgspec.msgpack.encode(
                {"type": "submit", "tenant": 5, "job_id": "j", "spec_json": b"", "submitted_at": 1}
            ),
        )
    # Forward compatibility: a newer writer's extra field is ignored, not an error.
    newer = {"type": "cancel", "tenant": "a", "job_id": "j", "colour": "red"}
    assert decode(JOB_COMMAND_DECODER, msgspec.msgpack.encode(newer)) == JobCancel("a", "j")
    with pytest.raises(DecodeError):
        decode(JOB_COMMAND_DECODER, b"\xc1 not msgpack")


def _spec(**overrides: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "kind": "sft",
        "tenant": "acme",
        "dataset": "reach-x",
        "steps": 10,
        "head": {"kind": "oft", "action_dim": 7, "chunk_len": 4},
    }
    spec.update(overrides)
    return spec


@pytest.mark.parametrize("dataset", ["/data/x", "data/reach2d", "../alice/reach", "./x"])
def test_a_dataset_path_in_a_spec_is_refused_naming_the_namespace(dataset: str) -> None:
    with pytest.raises(JobSpecError, match=r"dataset: .* is not a dataset id \(paths are not"):
        parse_job_spec(_spec(dataset=dataset))
    with pytest.raises(JobSpecError, match=r"dataset: .*joynexus data push"):
        parse_job_spec({"kind": "eval", "tenant": "acme", "policy_job": "j", "dataset": dataset})


def test_spec_errors_name_the_field() -> None:
    spec = parse_job_spec(_spec())
    assert isinstance(spec, SFTJobSpec) and spec.head.action_dim == 7
    with pytest.raises(JobSpecError, match=r"optimiser: unknown field"):
        parse_job_spec(_spec(optimiser={"lr": 1}))
    with pytest.raises(JobSpecError, match=r"head\.action_dim: Input should be greater"):
        parse_job_spec(_spec(head={"kind": "oft", "action_dim": 0}))
    with pytest.raises(JobSpecError, match=r"head\.kind: Input should be 'oft'"):
        parse_job_spec(_spec(head={"kind": "lstm", "action_dim": 2}))
    with pytest.raises(JobSpecError, match="exactly one of 'steps' or 'epochs'"):
        parse_job_spec(_spec(epochs=2))
    with pytest.raises(JobSpecError, match="tenant: String should match pattern"):
        parse_job_spec(_spec(tenant="Acme.*"))
    with pytest.raises(JobSpecError, match="kind: unknown job kind 'dance'"):
        parse_job_spec(_spec(kind="dance"))
    with pytest.raises(JobSpecError, match="not valid JSON"):
        parse_job_spec(b"{nope")
    with pytest.raises(JobSpecError, match="not UTF-8 JSON text"):
        parse_job_spec(b"{\xff}")


_SESSION = {"kind": "session", "tenant": "acme", "head": {"kind": "oft", "action_dim": 2}}


@pytest.mark.parametrize("seed", [-1, 2**32, 2**64])
@pytest.mark.parametrize(
    "spec",
    [
        _spec(),
        {"kind": "rl", "tenant": "acme", "env": "e", "head": {"kind": "oft"}, "iterations": 1},
        {"kind": "eval", "tenant": "acme", "policy_job": "j", "env": "e"},
        {**_SESSION, "head": {"kind": "oft", "action_dim": 2, "proprio_dim": 0}},
    ],
    ids=lambda s: s["kind"] if isinstance(s, dict) else None,
)
def test_a_seed_outside_32_bits_is_refused_naming_the_field(
    spec: dict[str, object], seed: int
) -> None:
    """Every seeded library the services use takes an unsigned 32-bit seed; a larger one also
    would not fit the wire's integers."""
    if spec["kind"] == "rl":
        spec = {**spec, "rl": {"algorithm": "grpo"}}
    parse_job_spec({**spec, "seed": 2**32 - 1})
    with pytest.raises(JobSpecError, match=r"^seed: Input should be (greater|less)"):
        parse_job_spec({**spec, "seed": seed})


_RL = {"kind": "rl", "tenant": "acme", "env": "e", "head": {"kind": "oft"}, "iterations": 1}
_SESSION_2D = {**_SESSION, "head": {"kind": "oft", "action_dim": 2, "proprio_dim": 0}}


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (_spec(), "checkpoint_every"),
        (_spec(), "optimizer.warmup_steps"),
        ({**_spec(), "steps": None}, "epochs"),
        (_spec(), "steps"),
        ({**_RL, "rl": {"algorithm": "grpo"}}, "rl.minibatch_size"),
        ({"kind": "eval", "tenant": "acme", "policy_job": "j", "env": "e"}, "policy_version"),
        (_SESSION_2D, "checkpoint_every"),
    ],
    ids=lambda v: v if isinstance(v, str) else v["kind"],
)
def test_a_count_past_its_bound_is_refused_naming_the_field(
    spec: dict[str, Any], field: str
) -> None:
    """Counts are bounded (MAX_COUNT): an unbounded one passed validation and then could not
    be encoded on the bus (msgpack carries 64-bit integers), failing the master's publish
    of an accepted job with an error naming no field."""

    def with_value(value: int) -> dict[str, Any]:
        *parents, leaf = field.split(".")
        out = dict(spec)
        inner = out
        for name in parents:
            inner[name] = dict(inner.get(name, {}))
            inner = inner[name]
        inner[leaf] = value
        return out

    parse_job_spec(with_value(MAX_COUNT))
    for value in (MAX_COUNT + 1, 2**64):
        with pytest.raises(JobSpecError, match=rf"^{re.escape(field)}: Input should be less"):
            parse_job_spec(with_value(value))


@pytest.mark.parametrize("kind", ["rl", "eval"])
def test_env_kwargs_ints_must_fit_64_bits_and_stay_ints(kind: str) -> None:
    base = (
        {**_RL, "rl": {"algorithm": "grpo"}}
        if kind == "rl"
        else {"kind": "eval", "tenant": "acme", "policy_job": "j", "env": "e"}
    )
    kwargs = {"n": 2**63 - 1, "low": -(2**63), "x": 0.5, "b": True, "s": "a"}
    spec = parse_job_spec({**base, "env_kwargs": kwargs})
    assert spec.env_kwargs == kwargs and type(spec.env_kwargs["n"]) is int  # type: ignore[union-attr]
    msgspec.msgpack.encode(spec.env_kwargs)  # type: ignore[union-attr]
    for big in (2**63, -(2**63) - 1, 2**64):
        with pytest.raises(
            JobSpecError, match=r"^env_kwargs: .*'n': -?\d+ is outside the 64-bit integers"
        ):
            parse_job_spec({**base, "env_kwargs": {**kwargs, "n": big}})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"optimizer": {"betas": [1.5, 0.999]}}, r"optimizer\.betas\.0: Input should be less"),
        ({"optimizer": {"betas": [0.9, -0.1]}}, r"optimizer\.betas\.1: Input should be greater"),
        ({"optimizer": {"weight_decay": float("inf")}}, r"optimizer\.weight_decay: .*finite"),
        ({"optimizer": {"grad_clip": float("nan")}}, r"optimizer\.grad_clip: .*finite"),
    ],
)
def test_optimizer_settings_that_no_optimizer_takes_are_refused(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(JobSpecError, match=message):
        parse_job_spec(_spec(**overrides))


def test_an_eval_holds_out_less_than_the_whole_dataset() -> None:
    eval_spec = {"kind": "eval", "tenant": "acme", "policy_job": "j", "dataset": "d"}
    parse_job_spec({**eval_spec, "val_fraction": 0.99})
    with pytest.raises(JobSpecError, match=r"val_fraction: Input should be less than 1"):
        parse_job_spec({**eval_spec, "val_fraction": 1.0})


def test_head_dims_filled_in_stay_within_the_heads_bounds() -> None:
    head = HeadSpec(kind="oft", action_dim=3)
    assert head.filled(7, 300 - 44).proprio_dim == 256
    assert head.filled(7, 0).action_dim == 3  # a dim the spec gives is kept
    with pytest.raises(
        JobSpecError,
        match=r"^head\.proprio_dim: Input should be less than or "
        r"equal to 256 \(omitted in the spec, so the dataset's proprio_dim was",
    ):
        head.filled(7, 300, "dataset")


def test_head_config_validates() -> None:
    with pytest.raises(ValueError, match=r"HeadConfig\.action_dim must be >= 1"):
        HeadConfig("oft", action_dim=0)


def test_heartbeats_written_before_progress_decode_as_no_progress() -> None:
    """Rolling upgrade: an older role's heartbeat (no ``progress``, ``busy_with``) reads as
    nothing finished and nothing holding it up (the health manager then judges it by its
    heartbeats alone)."""
    beat = decode(HEARTBEAT_DECODER, (GOLDEN / "heartbeat_before_progress.msgpack").read_bytes())
    assert isinstance(beat, Heartbeat) and beat.progress == 0 and beat.busy_with == ""
    assert beat == SAMPLES["heartbeat"]
