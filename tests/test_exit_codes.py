"""Every command exits with a code from the one table, trainer.schema.exits (docs/contract.md,
"Exit codes"): no command-line module returns or exits with a literal number, and the table
says what the docs say."""

from __future__ import annotations

import ast
from pathlib import Path

from trainer.schema import exits

ROOT = Path(__file__).resolve().parent.parent
COMMAND_MODULES = [
    "trainer/run.py", "trainer/flag_check.py", "trainer/nnunet_engine.py", "trainer/demo.py",
    "trainer/cli.py", "trainer/planning/preprocess.py", "trainer/inference/predict.py",
    "trainer/evaluation/evaluate.py", "trainer/evaluation/ensemble.py",
    "trainer/evaluation/best_configuration.py", "trainer/training/worker.py",
    "trainer/training/launch.py", "trainer/nnunet_ext/nnui_trainers.py", "app/main.py",
    "app/services/slurm/script.py", "app/services/slurm/control.py",
    "app/services/slurm/folds.py", "app/services/supervisor/main.py",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "app" / "cli").glob("*.py"))),
]  # fmt: skip


def literal_exits(path: Path) -> list[str]:
    """`return N` in a function that returns an int, `sys.exit(N)`, `SystemExit(N)`."""
    found = []
    for func in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        returns_int = func.returns is not None and ast.unparse(func.returns) == "int"
        for node in ast.walk(func):
            value = None
            if isinstance(node, ast.Return) and returns_int:
                value = node.value
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "sys.exit",
                "SystemExit",
            ):
                value = node.args[0] if node.args else None
            if isinstance(value, ast.Constant) and type(value.value) is int:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {func.name}")
    return found


def test_no_command_exits_with_a_literal_number() -> None:
    found = [hit for name in COMMAND_MODULES for hit in literal_exits(ROOT / name)]
    assert found == []


def test_a_planted_literal_is_caught(tmp_path: Path) -> None:
    planted = ROOT / "tests" / "_planted_exit.py"
    try:
        planted.write_text("import sys\n\ndef main() -> int:\n    return 2\n\nsys.exit(3)\n")
        assert len(literal_exits(planted)) == 1  # module-level sys.exit is not in a function
        planted.write_text("def main() -> int:\n    raise SystemExit(2)\n")
        assert literal_exits(planted) == ["tests/_planted_exit.py:2 main"]
    finally:
        planted.unlink(missing_ok=True)


def test_the_table_is_the_documented_one() -> None:
    pairs = [(exits.EXIT_OK, 0), (exits.EXIT_FAILED, 1), (exits.EXIT_REFUSED, 1),
             (exits.EXIT_USAGE, 2), (exits.EXIT_NOTHING, 3), (exits.EXIT_NOT_STARTED, 127),
             (exits.EXIT_INTERRUPTED, 130), (exits.exit_for_signal(15), 143)]  # fmt: skip
    assert [code for code, _ in pairs] == [value for _, value in pairs]
    docs = (ROOT / "docs" / "contract.md").read_text()
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 127 |", "| 128 + N |"):
        assert code in docs
