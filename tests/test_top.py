"""``joynexus top``'s arithmetic: a job's progress from its committed policy, a role's
utilisation from two heartbeats. (A real stack drawn by it: ``tests/test_usage.py``.)"""

from __future__ import annotations

import json

from rich.console import Console

from bench.top import Frame, Watcher, job_row, render
from schemas.health import Heartbeat
from schemas.jobs import JobRecord
from schemas.model import HeadConfig, OptimizerConfig
from schemas.train import OpenSlot, PolicyRecord


def _record(kind: str, status: str, spec: dict[str, object]) -> JobRecord:
    return JobRecord("acme", "j1", kind, status, json.dumps(spec).encode(), 0.0, 1.0)  # type: ignore[arg-type]


def _policy(version: int, step: int) -> PolicyRecord:
    slot = OpenSlot("acme", "j1", HeadConfig(kind="oft", action_dim=2), OptimizerConfig(), 0, 9)
    return PolicyRecord("acme", "j1", version, step, "o", "s", 0, slot, 0.0, {"loss": 0.25})


def test_progress_counts_sft_steps_and_rl_iterations() -> None:
    sft = job_row(_record("sft", "running", {"steps": 40}), _policy(3, 10))
    assert sft.progress == (10, 40) and sft.metrics == {"loss": 0.25} and sft.version == 3
    rl = job_row(_record("rl", "running", {"iterations": 6}), _policy(3, 99))
    assert rl.progress == (2, 6)  # version 1 is the initial weights
    assert job_row(_record("rl", "succeeded", {"iterations": 6}), None).progress == (6, 6)
    assert job_row(_record("eval", "running", {}), None).progress is None


def test_utilisation_is_busy_seconds_over_the_time_between_two_heartbeats() -> None:
    watcher = Watcher(js=None)  # type: ignore[arg-type]

    def beat(at: float, busy: float) -> Heartbeat:
        return Heartbeat("trainer", "t-1", 1, "h", 0.0, at, "0", gauges={"busy_s": busy})

    # The sender's clock runs 1000 s ahead of the watcher's: utilisation is a difference of
    # its own readings, and the age is measured on the watcher's clock from when it saw one.
    first = watcher._role_row("t-1", beat(1010.0, 1.0), 10.5)
    assert first.utilisation is None and first.age_s == 0.0
    second = watcher._role_row("t-1", beat(1012.0, 2.5), 12.2)
    assert second.utilisation == 0.75 and second.age_s == 0.0
    same = watcher._role_row("t-1", beat(1012.0, 2.5), 13.0)  # no new heartbeat: kept
    assert same.utilisation == 0.75 and abs(same.age_s - 0.8) < 1e-9
    console = Console(width=160, record=True)
    console.print(
        render(
            Frame(
                13.0,
                [second],
                [job_row(_record("sft", "running", {"steps": 4}), _policy(2, 1))],
                [],
            ),
            "x",
        )
    )
    text = console.export_text()
    assert "75%" in text and "1/4" in text and "acme" in text
