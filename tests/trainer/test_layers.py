"""The trainer's floor plan (docs/layout-trainer.md): its folders form layers and a module
imports only from its own layer or the ones below, so each stage can be read without the
stages that use it. Module-level and function-level imports both count.

    base (the schema/ package; legacy, stop, allocator, cli at the root)
    <- data <- planning <- network <- checkpoint <- inference <- evaluation
    <- training (training/, every other root module, nnunet_ext)

Also: no module re-exports another module's names (`__all__` lists only its own), and none
imports another module's private (`_name`) names."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "trainer"
# Root modules everything may use: the app contract, the stop flag, and what every CLI shares.
BASE = {"schema", "legacy", "stop", "allocator", "cli"}
LAYERS = ("base", "data", "planning", "network", "checkpoint", "inference", "evaluation",
          "training")  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """The layer of `trainer.x` or `trainer.folder.x`; a folder not in LAYERS fails loudly."""
    parts = module.split(".")[1:]
    if not parts:
        return "base"  # the package itself (an empty __init__)
    if len(parts) == 1 and (TRAINER / f"{parts[0]}.py").is_file():
        return "base" if parts[0] in BASE else "training"
    if parts[0] == "schema":  # the contract with the app: one module per topic, stdlib only
        return "base"
    if parts[0] == "nnunet_ext":
        return "training"
    if parts[0] not in LAYERS:
        raise AssertionError(f"trainer/{parts[0]}/ has no layer: add it to LAYERS")
    return parts[0]


def trainer_imports(tree: ast.AST) -> Iterator[tuple[str, list[str]]]:
    """(module, names imported from it) for every import of a trainer module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "trainer":
                    yield alias.name, []
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "trainer"
        ):
            yield node.module, [alias.name for alias in node.names]


def imported_modules(module: str, names: list[str]) -> set[str]:
    """`from trainer.x import y` imports module trainer.x.y when y is a module, else trainer.x."""
    found = set()
    for name in names or [""]:
        sub = f"{module}.{name}"
        folder = TRAINER.parent / sub.replace(".", "/")
        found.add(sub if name and (folder.with_suffix(".py").is_file() or folder.is_dir())
                  else module)  # fmt: skip
    return found


def trainer_files() -> list[Path]:
    return sorted(TRAINER.rglob("*.py"))


def trainer_sources() -> dict[str, str]:
    return {module_name(path): path.read_text() for path in trainer_files()}


def upward_imports(sources: dict[str, str]) -> list[str]:
    order = {layer: index for index, layer in enumerate(LAYERS)}
    found = []
    for importer, source in sources.items():
        for module, names in trainer_imports(ast.parse(source, filename=importer)):
            for imported in imported_modules(module, names):
                if order[layer_of(imported)] > order[layer_of(importer)]:
                    found.append(f"{importer} ({layer_of(importer)}) imports {imported} "
                                 f"({layer_of(imported)})")  # fmt: skip
    return found


def test_every_import_points_to_the_same_layer_or_below() -> None:
    assert upward_imports(trainer_sources()) == []


def test_a_planted_upward_import_is_caught() -> None:
    """The rule itself: a data module that imports the network is reported."""
    sources = {**trainer_sources(), "trainer.data.planted": "from trainer.network import unet\n"}
    assert upward_imports(sources) == [
        "trainer.data.planted (data) imports trainer.network.unet (network)"
    ]


def test_every_folder_has_a_layer() -> None:
    folders = {p.parent.name for p in trainer_files() if p.parent != TRAINER}
    assert folders - {"nnunet_ext", "schema"} <= set(LAYERS)


def test_no_private_names_from_other_modules() -> None:
    found = []
    for path in trainer_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for module, names in trainer_imports(tree):
            found += [f"{module_name(path)}: {module}.{n}" for n in names if n.startswith("_")]
    assert found == []


def test_no_module_re_exports_another_modules_names() -> None:
    """`__all__` may list only names the module defines itself (no facades)."""
    found = []
    for path in trainer_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = {alias.asname or alias.name for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) for alias in node.names}  # fmt: skip
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                listed = {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
                found += [f"{module_name(path)}: {n}" for n in sorted(listed & imported)]
    assert found == []
