"""bench/gpu_grouping.py runs end to end as a script: tiny on the CPU it writes the JSON of
``joynexus bench grouping`` (both stages, every cell, the cost table); its full-size preset
is a >= 0.5 B backbone; without CUDA the full run refuses with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_grouping
from tests.helpers import ROOT

#: Keys every ``bench grouping`` result has (bench/grouping.py's sweep).
GROUPING_KEYS = {
    "backbone",
    "backbone_id",
    "num_params",
    "device",
    "dtype",
    "threads",
    "repeats",
    "warmup",
    "num_views",
    "token_budget",
    "prefix_tokens",
    "torch",
    "split",
    "cost_table",
    "cells",
}


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_grouping", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.timeout(300)  # a fresh interpreter importing torch + transformers, on shared cores
def test_the_script_runs_tiny_on_the_cpu_and_writes_the_grouping_json(tmp_path: Path) -> None:
    out = tmp_path / "grouping-gpu.json"
    proc = run_script(
        "--tiny", "--tenants", "1,2", "--local-batch", "1", "--repeats", "1", "--warmup", "0",
        "--threads", "1", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert GROUPING_KEYS <= result.keys()
    assert result["preset"] == "tiny" and result["device"].startswith("cpu")
    assert result["dtype"] == "float32" and result["split"] is True
    assert result["cost_table"]["backbone_id"] == "idefics3-tiny"
    cells = {(c["stage"], c["tenants"], c["local_batch"]): c for c in result["cells"]}
    assert set(cells) == {(s, n, 1) for s in ("forward", "train_step") for n in (1, 2)}
    for cell in cells.values():
        assert cell["serial_ms"] > 0 and cell["grouped_ms"] > 0 and cell["speedup"] > 0
        assert cell["forwards"] >= 1
    assert "stage train_step" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.timeout(300)
def test_the_full_size_run_refuses_without_cuda_naming_the_way_out() -> None:
    proc = run_script("--tenants", "1", "--local-batch", "1")
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--tiny" in proc.stderr


def test_the_full_size_preset_is_a_half_billion_parameter_backbone() -> None:
    # Built on the meta device: the real shapes, no memory and no init time.
    model, _ = gpu_grouping.build_model("0.6b", "meta")
    params = sum(p.numel() for p in model.model.parameters())  # without the tied LM head
    assert params >= gpu_grouping.MIN_PARAMS, f"{params:,}"
