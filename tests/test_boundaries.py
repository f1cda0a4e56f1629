"""Import rules (docs/layout.md): the TUI never pulls in torch, the trainer never pulls in
textual, and no import cycle inside app/ or trainer/ (module-level and function-level imports both:
a cycle hidden in a function is the same tangle, only deferred)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
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
    outside = {m for m in used if m != "trainer.schema" and not m.startswith("trainer.schema.")}
    assert outside == set(), outside


def test_the_schema_is_one_small_module_per_topic() -> None:
    """trainer.schema is a package of topic modules, each of them short, none of them a
    facade: its __init__ holds a docstring only."""
    folder = ROOT / "trainer" / "schema"
    topics = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert {"events", "status", "tree", "atomic", "flags", "exits"} <= topics
    init = ast.parse((folder / "__init__.py").read_text())
    assert all(isinstance(n, ast.Expr) for n in init.body), (
        "trainer/schema/__init__.py: docstring only"
    )
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert max(sizes.values()) <= 300, sizes


def test_trainer_package_init_is_empty() -> None:
    assert (ROOT / "trainer" / "__init__.py").read_text().strip() == ""


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("app.main", ["torch", "numpy", "blosc2", "safetensors"]),
        *(
            (f"trainer.schema.{p.stem}", ["torch", "numpy"])
            for p in sorted((ROOT / "trainer" / "schema").glob("*.py"))
        ),
    ],
)
def test_importing_does_not_pull_heavy_modules(module: str, absent: list[str]) -> None:
    code = (
        f"import {module}, sys; bad = [m for m in {absent!r} if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- import cycles --------------------------------------------------------------------

# Every import cycle fails the test (the four of issue 16 are cut).
CYCLES_BEING_CUT_ELSEWHERE: frozenset[frozenset[str]] = frozenset()
CYCLE_PACKAGES = ("app", "trainer")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that runs, skipping `if TYPE_CHECKING:` bodies (never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None)
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imported_modules(
    path: Path, known: set[str], root: Path = ROOT, with_types: bool = False
) -> set[str]:
    """The project modules `path` imports anywhere (top level or inside a function).
    `from pkg import name` counts as `pkg.name` when that is a module, else as `pkg`."""
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree) if with_types else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != here}


def import_graph(
    root: Path = ROOT, packages: tuple[str, ...] = CYCLE_PACKAGES, with_types: bool = False
) -> dict[str, set[str]]:
    """Module -> the project modules it imports; `with_types` counts the imports under
    `if TYPE_CHECKING:` too (a circle of types is the same tangle for a reader)."""
    paths = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    known = {module_name(p, root) for p in paths}
    return {module_name(p, root): imported_modules(p, known, root, with_types) for p in paths}


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(frozenset(component))
    return cycles


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [{"a", "b"}]),
        (
            {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}},
            [{"a", "b", "c"}, {"d", "e"}],
        ),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_cycle_detection_finds_every_cycle(graph: dict, expected: list) -> None:
    assert sorted(map(sorted, import_cycles(graph))) == sorted(map(sorted, expected))


def test_graph_counts_function_level_and_relative_imports_not_type_checking(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py", "c.py", "d.py", "e.py"):
        (pkg / name).write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")  # function level
    (pkg / "b.py").write_text("from . import a\nfrom .sub.x import y\n")  # relative
    (pkg / "sub" / "x.py").write_text("from ..c import thing\nimport pkg.d\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n"
    )
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.a", "pkg.sub.x"}
    assert graph["pkg.sub.x"] == {"pkg.c", "pkg.d"}
    assert graph["pkg.d"] == set()  # TYPE_CHECKING imports never run
    assert import_cycles(graph) == [frozenset({"pkg.a", "pkg.b"})]
    assert import_graph(tmp_path, ("pkg",), with_types=True)["pkg.d"] == {"pkg.e"}


def test_no_import_cycles_in_app_and_trainer() -> None:
    cycles = [c for c in import_cycles(import_graph()) if c not in CYCLES_BEING_CUT_ELSEWHERE]
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


# ---- the floor plan of app/services (issue #26) -----------------------------------------

# A room is a folder of app/services, or a module at its top. A room imports only rooms of
# lower layers (and its own modules): each flow reads bottom-up through named folders, and
# no folder cycle can form. Siblings of one layer stay independent of each other.
SERVICE_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"machine"}),  # what the box is (NVML, /proc, host load): no job knowledge
    frozenset({"tail"}),  # reading growing files by byte offset
    frozenset({"nnunet"}),  # stock nnU-Net runs nnui did not start (watch-only)
    frozenset({"jobs"}),  # nnui's jobs as records, and what is read about them
    frozenset({"launch", "signals", "export"}),  # starting; stop and kill; curves out
    frozenset({"supervisor", "cross_validation", "slurm", "class_dice"}),  # composed
)
SERVICES = "app.services."


def service_room(module: str) -> str | None:
    return module[len(SERVICES) :].split(".")[0] if module.startswith(SERVICES) else None


def layer_violations(
    graph: dict[str, set[str]], layers: tuple[frozenset[str], ...] = SERVICE_LAYERS
) -> list[str]:
    """`module -> imported` for every import of a room in the same or a higher layer (and
    every room that is in no layer)."""
    rank = {room: i for i, rooms in enumerate(layers) for room in rooms}
    found = []
    for module, imported in sorted(graph.items()):
        room = service_room(module)
        if room is None:
            continue
        if room not in rank:
            found.append(f"{module}: its room {room!r} is in no layer of SERVICE_LAYERS")
            continue
        for target in sorted(imported):
            other = service_room(target)
            if other is not None and other != room and rank.get(other, len(layers)) >= rank[room]:
                found.append(f"{module} -> {target}")
    return found


def test_layer_rule_finds_upward_sideways_and_unplaced_rooms() -> None:
    graph = {
        "app.services.machine.gpus": {"app.services.jobs.registry"},  # upward
        "app.services.launch.launcher": {"app.services.signals.send"},  # sideways
        "app.services.jobs.views": {"app.services.jobs.registry", "app.services.tail"},
        "app.services.attic.old": set(),  # a new room nobody placed
        "app.tui": {"app.services.supervisor.main"},  # outside app/services: not ruled here
    }
    assert layer_violations(graph) == [
        "app.services.attic.old: its room 'attic' is in no layer of SERVICE_LAYERS",
        "app.services.launch.launcher -> app.services.signals.send",
        "app.services.machine.gpus -> app.services.jobs.registry",
    ]


def test_app_services_folders_import_only_lower_layers() -> None:
    assert layer_violations(import_graph(ROOT, ("app",))) == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for module in graph.get(todo.pop(), ()):
            if module not in seen:
                seen.add(module)
                todo.append(module)
    return seen


def test_the_supervisor_process_never_loads_the_tui_view_model() -> None:
    """The per-job supervisor lives for the whole job: it reads the machine and the
    registry, never the board's views (jobs/views.py), screens, widgets or the CLI."""
    graph = import_graph(ROOT, ("app",))
    loaded = reachable(graph, "app.services.supervisor.main")
    ui = ("app.services.jobs.views", "app.tui", "app.screens", "app.widgets", "app.cli")
    assert sorted(m for m in loaded if m.startswith(ui)) == []


def test_the_legacy_module_is_a_leaf() -> None:
    """app/legacy.py (nnui 0.1 compatibility, removed at 1.0) depends on no app module."""
    graph = import_graph(ROOT, ("app",))
    assert graph["app.legacy"] == set()


# ---- no facades, no private cross-imports -------------------------------------------------

# trainer/ joins these two rules once its own layout move (the other half of issue #26) has
# made its remaining re-exports and private imports public.
FACADE_RULE_PACKAGES = ("app",)


def bound_by_imports(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def reexports(path: Path) -> list[str]:
    """Names of `__all__` that the module imported instead of defining (a facade)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imported = bound_by_imports(tree)
    listed: list[str] = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            listed += [e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)]
    return sorted(name for name in listed if name in imported)


def private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """`module._name` for every private name this file takes from another project module
    (`from m import _name`, or `m._name` on an imported project module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    project = ("app", "trainer")
    modules: dict[str, str] = {}  # local name -> project module
    found = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(project):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.add(f"{node.module}.{alias.name}")
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(project) and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.add(f"{modules[node.value.id]}.{node.attr}")
    return sorted(found)


def test_facade_and_private_rules_find_their_plants(tmp_path: Path) -> None:
    facade = tmp_path / "facade.py"
    facade.write_text(
        'from app.x import helper, other\n\ndef own():\n    pass\n\n__all__ = ["helper", "own"]\n'
    )
    assert reexports(facade) == ["helper"]
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text(
        "from app.services import tail\nfrom app.services.tail import _ByteTail, TextTail\n"
        "from os import _exit\n\ndef f():\n    return tail._open_regular, tail.TextTail\n"
    )
    assert private_imports(sneaky) == [
        "app.services.tail._ByteTail",
        "app.services.tail._open_regular",
    ]


@pytest.mark.parametrize("package", FACADE_RULE_PACKAGES)
def test_no_module_reexports_another_modules_names(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): reexports(path)
        for path in sorted((ROOT / package).rglob("*.py"))
        if reexports(path)
    }
    assert offenders == {}, "import these names from the module that defines them"


@pytest.mark.parametrize("package", FACADE_RULE_PACKAGES)
def test_no_module_imports_another_modules_private_names(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): private_imports(path)
        for path in sorted((ROOT / package).rglob("*.py"))
        if private_imports(path)
    }
    assert offenders == {}, "make the name public, or keep its use inside its module"


# ---- one owner per outside system ------------------------------------------------------

# (pattern in the code, the only modules of app/ and trainer/ that may use it, why)
OWNERS = [
    (re.compile(r"\bPopen\("),
     {"app/services/launch/launcher.py", "app/services/supervisor/main.py"},
     "jobs are started by the launcher and run under their supervisor"),
    (re.compile(r"open\([^)]*[\"']/proc/|Path\([\"']/proc"),
     {"app/services/machine/procs.py", "trainer/checkpoint/atomic.py"},
     "/proc: procs in the app; the trainer (no app imports) only asks if a tmp writer lives"),
    (re.compile(r"\bpthread_sigmask\(|SIG_IGN"),
     {"trainer/stop.py", "app/services/supervisor/main.py"},
     "signal masks and dispositions: trainer.stop (the supervisor ignores USR1/HUP itself)"),
    (re.compile(r"\bimport pynvml|\bfrom pynvml"), {"app/services/machine/gpus.py"},
     "NVML: gpus only"),
    (re.compile(r"\bimport blosc2|\bfrom blosc2"), {"trainer/data/blosc_io.py"}, "blosc2"),
    (re.compile(r"\bimport safetensors|\bfrom safetensors"),
     {"trainer/checkpoint/store.py", "trainer/checkpoint/format.py", "trainer/inference/predict.py",
      "trainer/inference/engine.py"}, "safetensors"),
]  # fmt: skip


@pytest.mark.parametrize(("pattern", "owners", "why"), OWNERS, ids=[o[2][:30] for o in OWNERS])
def test_one_owner_per_outside_system(pattern, owners, why) -> None:
    users = set()
    for package in ("app", "trainer"):
        for path in (ROOT / package).rglob("*.py"):
            code = "\n".join(
                line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
            )
            if pattern.search(code):
                users.add(str(path.relative_to(ROOT)))
    assert users <= owners, f"{why}: also used in {sorted(users - owners)}"


# ---- function length ------------------------------------------------------------------

MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_ALLOWED: dict[str, set[str]] = {}  # none: every function is split


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


def test_no_import_circle_in_the_app_even_through_type_only_imports() -> None:
    """The screens share their types through leaf modules (screens/seam.py: the app's config,
    services and seam; screens/choices.py: the dialogs' rows), so no screen imports app.tui
    or another screen for a type, and the app's graph has no circle even with the
    `if TYPE_CHECKING:` imports counted."""
    cycles = import_cycles(import_graph(packages=("app",), with_types=True))
    assert cycles == [], "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_a_type_only_circle_is_caught(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n"
    )
    assert import_cycles(import_graph(tmp_path, ("pkg",))) == []
    assert import_cycles(import_graph(tmp_path, ("pkg",), with_types=True)) == [
        frozenset({"pkg.a", "pkg.b"})
    ]
