"""Job states come from trainer.schema.status.State and its named sets, never spelled as strings.

A string that equals a state and is compared (`state == "running"`, `state in ("queued",
"starting")`, `case "failed":`) or grouped into a tuple/set/list of states is a second
list of states that drifts from the enum. Other words that happen to equal a state (a curve
named "running", nnU-Net's "starting" log phase) are named constants in their modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

from trainer.schema.status import State

ROOT = Path(__file__).resolve().parents[1]
STATE_WORDS = frozenset(state.value for state in State)


def _state_word(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in STATE_WORDS


def _members(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return list(node.elts)
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"frozenset", "set"}:
        return [m for arg in node.args for m in _members(arg)]
    return [node]


def state_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, word) of every state spelled as a string in a comparison, a `case`, or a
    tuple/set/list made of state words only (a hand-made group of states)."""
    found: dict[int, ast.Constant] = {}  # by id: a grouped comparison is seen twice
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            candidates = [m for side in (node.left, *node.comparators) for m in _members(side)]
        elif isinstance(node, ast.MatchValue):
            candidates = [node.value]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) > 1:
            candidates = node.elts if all(_state_word(m) for m in node.elts) else []
        else:
            continue
        found.update(
            (id(m), m) for m in candidates if isinstance(m, ast.Constant) and _state_word(m)
        )
    ordered = sorted(found.values(), key=lambda m: (m.lineno, m.col_offset))
    return [(m.lineno, m.value) for m in ordered]


def test_the_scan_finds_states_spelled_as_strings() -> None:
    source = """
if view.state == "running": pass
if state in ("queued", "starting"): pass
WAITING = frozenset({"queued", "starting"})
match state:
    case "failed": pass
if field == "train_loss" or phase == RUNNING_FIELD: pass
LABELS = {"running": "run"}
"""
    words = [word for _line, word in state_literals(ast.parse(source))]
    assert words == ["running", "queued", "starting", "queued", "starting", "failed"]


def test_no_job_state_is_spelled_as_a_string_in_app_or_trainer() -> None:
    offenders = []
    for folder in ("app", "trainer"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            rel = path.relative_to(ROOT)
            offenders += [f"{rel}:{line}: {word!r}" for line, word in state_literals(tree)]
    assert not offenders, "use trainer.schema.status.State or its named sets:\n" + "\n".join(
        offenders
    )
