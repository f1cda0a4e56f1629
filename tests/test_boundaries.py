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


MAX_FUNCTION_LINES = 60
# Functions still being split on another branch; the lead empties this after merging.
LONG_FUNCTIONS_ALLOWED = {"trainer/run.py": {"build_parser", "resolve_config"}}


def long_functions(path: Path, max_lines: int) -> list[tuple[str, int]]:
    """(qualified name, line count) of every function or method longer than max_lines."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > max_lines:
                        found.append((name, lines))
                name += "."
            visit(child, name)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def test_long_functions_finds_nested_methods(tmp_path: Path) -> None:
    body = "\n".join(f"        x = {i}" for i in range(3))
    source = f"class A:\n    def m(self):\n{body}\n\n\ndef short():\n    pass\n"
    (tmp_path / "m.py").write_text(source)
    assert long_functions(tmp_path / "m.py", max_lines=3) == [("A.m", 4)]


def test_no_function_is_longer_than_the_limit() -> None:
    offenders = {}
    for package in ("app", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            allowed = LONG_FUNCTIONS_ALLOWED.get(relative, set())
            long = [
                f"{name} ({lines} lines)"
                for name, lines in long_functions(path, MAX_FUNCTION_LINES)
                if name not in allowed
            ]
            if long:
                offenders[relative] = long
    assert offenders == {}, f"split these into helpers of <= {MAX_FUNCTION_LINES} lines"
