"""``joynexus bench removal`` runs end to end: its removals succeed and it writes its rows."""

from __future__ import annotations

import json
from pathlib import Path

from bench import removal


def test_the_removal_bench_removes_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "removal.json"
    assert removal.main(["--records", "3,7", "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["records"] for r in rows] == [3.0, 7.0]
    assert all(r["job_rm_ms"] > 0 and r["dataset_rm_ms"] > 0 for r in rows)
