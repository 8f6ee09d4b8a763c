"""One tenant's flood stays with that tenant (``joynexus bench flood`` at a small size, on a
real local stack): a calm tenant trains and asks for actions while a flooding tenant, from
its own process with its own identity, sends garbage requests, malformed low-level calls and
unservable act requests as fast as it is answered. Every flood request gets a specific error
back; the calm tenant's jobs give the same losses as without the flood, none of its work is
dead-lettered, and no role process dies. The throughput ratios are printed, never asserted
(absolute and relative times on a shared 2-core machine are noise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import flood


@pytest.mark.stack
def test_a_flooding_tenant_gets_errors_and_the_calm_tenant_its_results(tmp_path: Path) -> None:
    result = flood.run(
        tmp_path, steps=20, batch=4, phases=("none", "garbage", "bad-call", "bad-act")
    )
    flood.print_table(result)
    answers = {r["flood"]: r["flood_requests"] for r in result["phases"] if r["flood"] != "none"}
    expected = {
        "garbage": {"malformed", "unavailable"},  # unavailable: over the in-flight cap
        "bad-call": {"call_error"},
        "bad-act": {"invalid", "unavailable"},
    }
    for kind, codes in expected.items():
        tally = answers[kind][kind]
        assert tally["sent"] > 0 and tally["unanswered"] == 0, (kind, tally)
        assert set(tally["answers"]) <= codes, (kind, tally)
    assert result["calm_losses_equal"]
    assert result["calm_dead_letters"] == 0
    # The bad calls were accepted onto TRAIN and dead-lettered there, as the flooder's.
    assert result["flood_dead_letters"] >= answers["bad-call"]["bad-call"]["sent"] // 2
    assert result["roles_alive"]
