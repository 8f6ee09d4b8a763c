"""``joynexus bench learn`` end to end, small: demos, SFT of a policy and its blind
baseline side by side, closed-loop evaluation and RL, all over a real stack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import learn
from services.envs.sims import REACH2D_ID


@pytest.mark.stack
@pytest.mark.timeout(600)
def test_bench_learn_reports_policy_blind_and_rl_success(tmp_path: Path) -> None:
    out = tmp_path / "learn.json"
    code = learn.main(
        [
            "--env", REACH2D_ID,
            "--demos", "8",
            "--steps", "20",
            "--batch-size", "8",
            "--eval-episodes", "4",
            "--rl-iterations", "1",
            "--rl-episodes", "4",
            "--max-episode-steps", "30",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert result["env"] == REACH2D_ID and result["demos"] == 8 and result["eval_episodes"] == 4
    for key in ("success_rate", "blind_success_rate", "rl_success_rate"):
        assert 0.0 <= result[key] <= 1.0, key
        # Four episodes: a rate is a multiple of 1/4, so it was measured, not filled in.
        assert (result[key] * 4) == int(result[key] * 4), key
    assert result["demo_frames"] >= 8 and result["wall_s"] > 0


def test_proprio_extras_go_to_the_env_of_both_policies_and_nothing_else() -> None:
    """``--proprio-extras`` is an env constructor argument (recording, training, evaluation);
    left out, the env is built as the task defines it."""
    parse = learn.build_parser().parse_args
    assert learn.env_kwargs(parse(["--proprio-extras", "cube_pose"])) == {
        "proprio_extras": "cube_pose"
    }
    assert learn.env_kwargs(parse([])) == {}
