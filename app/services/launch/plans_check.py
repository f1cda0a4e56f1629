"""Which plans and configurations a preprocessed dataset holds, for `nnui launch`'s checks:
the configuration is checked first (across every plans file), then the plans the launch
names; each refusal names what exists and the flag that selects it (`-- -p PLANS`)."""

from __future__ import annotations

import json
from pathlib import Path

# JSON files of a preprocessed dataset that are not plans
_NOT_PLANS = {"dataset.json", "dataset_fingerprint.json", "splits_final.json"}


def configuration_names(dataset_folder: Path, plans_file: str) -> list[str] | None:
    """Configurations in the plans file (stock cascade ones included); None: no plans file."""
    try:
        data = json.loads((dataset_folder / plans_file).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        return []
    configurations = data.get("configurations") if isinstance(data, dict) else None
    return sorted(configurations) if isinstance(configurations, dict) else []


def existing_plans(dataset_folder: Path) -> dict[str, list[str]]:
    """plans name (the file's stem) -> its configurations, for every plans file there."""
    found = {}
    paths = sorted(dataset_folder.glob("*.json")) if dataset_folder.is_dir() else []
    for path in paths:
        if path.name in _NOT_PLANS:
            continue
        names = configuration_names(dataset_folder, path.name)
        if names:
            found[path.stem] = names
    return found


def plans_problems(
    dataset_folder: Path, configuration: str, plans: str, plans_file: str, preprocess: str
) -> list[str]:
    """One line per problem with the configuration, then with the plans (`preprocess`: the
    command that makes plans, for a dataset without any)."""
    dataset = dataset_folder.name
    available = existing_plans(dataset_folder)
    every = sorted({c for names in available.values() for c in names})
    if available and configuration not in every:
        return [
            f"unknown configuration {configuration!r} for {dataset} (its plans have: "
            f"{', '.join(every)})"
        ]
    names = configuration_names(dataset_folder, plans_file)
    having = [p for p, cs in available.items() if configuration in cs and p != plans]
    hint = f"; {_listed(having)} {configuration}: add `-- -p {having[0]}`" if having else ""
    if names is None:
        if not available:
            return [
                f"{dataset} has no plans in {dataset_folder}: preprocess it first ({preprocess})"
            ]
        return [f"{dataset} has no plans {plans_file} (it has {', '.join(available)}){hint}"]
    if configuration not in names:
        known = ", ".join(names) or "none"
        return [
            f"unknown configuration {configuration!r} for {dataset} (plans {plans} has: "
            f"{known}){hint}"
        ]
    return []


def _listed(plans: list[str]) -> str:
    return f"plans {plans[0]} has" if len(plans) == 1 else f"plans {', '.join(plans)} have"
