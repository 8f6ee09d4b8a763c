"""Regenerate the golden encodings: ``python -m tests.golden.regen``. Only run this for an
intended schema change, and review the diff: existing bytes must keep decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bus.codec import encode
from schemas.dead import DeadLetter
from schemas.events import Accepted, PolicyPublished, Progress, Rejected, StateChanged
from schemas.health import Heartbeat
from schemas.jobs import JobCancel, JobRecord, JobSubmit
from schemas.model import HeadConfig, Observation
from schemas.tensor import Tensor

HERE = Path(__file__).parent

SAMPLES: dict[str, object] = {
    "job_submit": JobSubmit("acme", "sft-0001", b'{"kind":"sft"}', 1767225600.0),
    "job_cancel": JobCancel("acme", "sft-0001", "no longer needed"),
    "job_record": JobRecord(
        "acme",
        "sft-0001",
        "sft",
        "running",
        b'{"kind":"sft"}',
        1767225600.0,
        1767225601.5,
        "",
        {"loss": 0.25},
        3,
    ),
    "event_accepted": Accepted("acme", "sft-0001", "sft", 1767225600.0),
    "event_rejected": Rejected("acme", "sft-0001", "head.action_dim: too small", 1767225600.0),
    "event_state": StateChanged("acme", "sft-0001", "succeeded", 1767225600.0),
    "event_progress": Progress("acme", "sft-0001", 5, 10, {"loss": 0.5}, 1767225600.0),
    "event_policy": PolicyPublished("acme", "sft-0001", 2, "acme/sft-0001/v2", 20, 1767225600.0),
    "heartbeat": Heartbeat(
        "master", "master-a-1", 1234, "host", 1767225600.0, 1767225601.0, "0.1.0", 2, {"lag": 1.0}
    ),
    "dead_letter": DeadLetter(
        "JOBS",
        "nexus.job.acme.submit",
        "master",
        7,
        1,
        "PoisonError: bad",
        "PoisonError",
        b"\x01\x02",
        1767225600.0,
        "acme",
    ),
    "tensor_f32": Tensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3)),
    "head_config": HeadConfig("oft", action_dim=7, chunk_len=4, proprio_dim=8),
    "observation": Observation(
        [Tensor.from_numpy(np.zeros((2, 2, 3), dtype=np.uint8))],
        "push the cube",
        Tensor.from_numpy(np.ones(3, dtype=np.float32)),
    ),
}

if __name__ == "__main__":
    for name, message in SAMPLES.items():
        (HERE / f"{name}.msgpack").write_bytes(encode(message))
    print(f"wrote {len(SAMPLES)} golden samples to {HERE}")
