"""DESIGN.md §1's import rules, read from the source: every ``import`` of every module
(lazy ones inside functions included) of each top-level package names only the packages
that the layout table lets it use, and no role's package imports another role's."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT

OURS = ("schemas", "bus", "vla", "services", "clients", "bench", "tests")
#: What each package may import besides itself (DESIGN.md §1; bus and schemas are the lower
#: layers every user of the bus goes through).
ALLOWED = {
    "schemas": set(),
    "bus": {"schemas"},
    "vla": {"schemas"},
    "services": {"bus", "schemas", "vla"},
    "clients": {"bus", "schemas"},
    "bench": {"clients", "services", "vla", "bus", "schemas"},
}
ROLES = ("master", "trainer", "inferencer", "envs", "health", "backbone")


def imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, dotted module)`` of every absolute import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            # ``from bus import checkpoints`` imports bus.checkpoints
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def offending(package: str, allowed: set[str]) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imports_of(path):
            top = module.split(".")[0]
            if top in OURS and top != package and top not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_layout_allows(package: str) -> None:
    assert offending(package, ALLOWED[package]) == []


def test_the_checker_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from bus import checkpoints\ndef f():\n    import clients.sdk\n")
    found = {m for _, m in imports_of(source)}
    assert {"bus", "bus.checkpoints", "clients.sdk"} <= found


def test_no_module_imports_by_name_string() -> None:
    """Imports are plain statements (so the checks above see them), never strings."""
    found = [
        f"{path.relative_to(ROOT)}"
        for package in ALLOWED
        for path in sorted((ROOT / package).rglob("*.py"))
        if "import_module(" in path.read_text() or "__import__(" in path.read_text()
    ]
    assert found == []


def _cross_role_imports(role: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / "services" / role).rglob("*.py")):
        for line, module in imports_of(path):
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != role:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("role", ROLES)
def test_no_role_imports_another_roles_package(role: str) -> None:
    assert _cross_role_imports(role) == []


def test_the_joynexus_command_loads_only_the_sdk_until_an_operator_command_runs() -> None:
    probe = (
        "import sys; from bench import cli; cli.build_parser(); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'services', 'vla')); print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
