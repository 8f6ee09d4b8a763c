"""Our code never writes the process environment, at import or at run time.

Each check runs in a fresh interpreter whose ``os.environ`` records every write
(``__setitem__``/``__delitem__``, so ``setdefault``/``update``/``pop`` too, and
``os.putenv``/``os.unsetenv``) with the first caller outside ``os``. Third-party libraries do
write it (numpy briefly sets ``OPENBLAS_MAIN_FREE``, gymnasium sets
``PYGAME_HIDE_SUPPORT_PROMPT`` at import; cv2 and SAPIEN, imported by ManiSkill, set library
paths): only writes from this repository's files fail the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT

_RECORDER = textwrap.dedent(
    """
    import json, os, sys, traceback

    WRITES = []

    def _writer():
        for frame in reversed(traceback.extract_stack()[:-2]):
            name = frame.filename
            if name.startswith("<") or name.endswith(("/os.py", "_collections_abc.py")):
                continue
            return f"{name}:{frame.lineno}"
        return "?"

    def _recording(real):
        def write(*args, **kwargs):
            WRITES.append(_writer())
            return real(*args, **kwargs)
        return write

    _Environ = type(os.environ)
    _Environ.__setitem__ = _recording(_Environ.__setitem__)
    _Environ.__delitem__ = _recording(_Environ.__delitem__)
    os.putenv = _recording(os.putenv)
    os.unsetenv = _recording(os.unsetenv)
    BEFORE = dict(os.environ)

    def report(**extra):
        added = sorted(set(os.environ) - set(BEFORE))
        print(json.dumps({"writes": sorted(set(WRITES)), "added": added, **extra}))
    """
)


def _run(body: str, timeout: float = 240.0) -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MS_")}
    proc = subprocess.run(
        [sys.executable, "-c", _RECORDER + textwrap.dedent(body) + "\nreport()\n"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, list[str]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _ours(writes: list[str]) -> list[str]:
    root, venv = str(ROOT) + os.sep, str(ROOT / ".venv") + os.sep
    return [w for w in writes if w.startswith(root) and not w.startswith(venv)]


def test_the_recorder_attributes_a_write_to_its_file() -> None:
    # The checks below can fail: a write from a file of ours is caught and named.
    result = _run(
        """
        exec(compile("import os\\nos.environ.setdefault('JOYNEXUS_PROBE', '1')",
                     os.path.join(os.getcwd(), "tests", "probe.py"), "exec"))
        """
    )
    assert _ours(result["writes"]) == [f"{ROOT / 'tests' / 'probe.py'}:2"]
    assert result["added"] == ["JOYNEXUS_PROBE"]


def test_vla_data_imports_without_torch_and_writes_nothing() -> None:
    result = _run(
        """
        import vla.data
        assert "torch" not in sys.modules, "vla.data pulled in torch"
        """
    )
    assert _ours(result["writes"]) == [] and result["added"] == []


def test_env_worker_modules_and_their_work_write_nothing(tmp_path: Path) -> None:
    result = _run(
        f"""
        import numpy as np
        import services.envs.service, services.envs.maniskill
        from services.envs.adapters import make_adapter
        from services.envs.datasets import iter_batches, record
        from vla.data import check_dataset, load_dataset

        adapter = make_adapter("JoyNexus/Reach2D-v0", image_size=16)
        adapter.reset(seed=0)
        adapter.step(np.zeros(adapter.action_dim, np.float32))
        adapter.close()
        record("JoyNexus/Reach2D-v0", 2, {str(tmp_path)!r} + "/ds", seed=0, max_steps=3)
        check_dataset({str(tmp_path)!r} + "/ds")
        next(iter_batches(load_dataset({str(tmp_path)!r} + "/ds"), 2, 2))
        """
    )
    assert _ours(result["writes"]) == []


@pytest.mark.maniskill
@pytest.mark.heavy  # ~23 s: a fresh process imports ManiSkill and compiles its shaders
def test_building_and_stepping_a_maniskill_task_writes_nothing_of_ours() -> None:
    result = _run(
        """
        import numpy as np
        from services.envs.adapters import make_adapter

        adapter = make_adapter("PushCube-v1", image_size=32, max_episode_steps=2)
        adapter.reset(seed=0)
        adapter.step(np.zeros(adapter.action_dim, np.float32))
        adapter.close()
        """
    )
    assert _ours(result["writes"]) == []
    assert not [name for name in result["added"] if name.startswith("MS_")]
