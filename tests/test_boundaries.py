"""DESIGN §1 import rules: the TUI never pulls in torch, the trainer never pulls in textual."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP_FORBIDDEN = {"torch", "numpy", "blosc2", "safetensors", "nibabel", "scipy"}
TRAINER_FORBIDDEN = {"textual", "app"}
SERVICES_FORBIDDEN = {"textual"}


def top_level_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def trainer_modules_imported_by_app(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
            if node.module == "trainer":
                found.update(f"trainer.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("trainer"))
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("app", APP_FORBIDDEN), ("app/services", SERVICES_FORBIDDEN), ("trainer", TRAINER_FORBIDDEN)],
)
def test_packages_respect_import_rules(package: str, forbidden: set[str]) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(top_level_imports(path) & forbidden)
        for path in sorted((ROOT / package).rglob("*.py"))
        if top_level_imports(path) & forbidden
    }
    assert offenders == {}


def test_app_imports_only_the_schema_from_the_trainer() -> None:
    used = set()
    for path in (ROOT / "app").rglob("*.py"):
        used |= trainer_modules_imported_by_app(path)
    assert used <= {"trainer.schema"}, used


def test_trainer_package_init_is_empty() -> None:
    assert (ROOT / "trainer" / "__init__.py").read_text().strip() == ""


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("app.main", ["torch", "numpy", "blosc2", "safetensors"]),
        ("trainer.schema", ["torch", "numpy"]),
    ],
)
def test_importing_does_not_pull_heavy_modules(module: str, absent: list[str]) -> None:
    code = (
        f"import {module}, sys; bad = [m for m in {absent!r} if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
