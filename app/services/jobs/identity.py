"""A run's identity: (results tree, dataset, trainer, plans, configuration, fold).

Two runs of the same dataset, configuration and fold in two results trees are two runs: every
view groups by the whole identity and labels a row of another tree than the default one with
a short tree name. The tree of a job is read from its run folder
(`TREE/DatasetNNN_Name/Trainer__Plans__configuration/fold_F`), the one place every kind of
job (launched, adopted, ended unseen) names. Pure path work: no file is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

# Names that say nothing about a tree: its label is then its parent folder's name.
GENERIC_NAMES = frozenset({"results", "nnunet_results", "nnui_results", "nnui_data", "output"})
MAX_LABEL = 24


def results_tree(run_dir: str) -> str:
    """The results tree of a run folder (absolute, symlinks resolved), '' without a folder."""
    return _tree_of(os.path.abspath(run_dir)) if run_dir else ""


@lru_cache(maxsize=8192)  # folders never change their tree; rows are grouped every second
def _tree_of(run_dir: str) -> str:
    path = Path(run_dir)
    # Only a folder laid out as TREE/DatasetNNN_Name/Trainer__Plans__configuration/fold_F
    # names its tree: three levels above anything else is no results tree (a test's tmp).
    if len(path.parts) <= 3 or not path.name.startswith("fold_"):
        return ""
    if "__" not in path.parent.name or not path.parent.parent.name.startswith("Dataset"):
        return ""
    return os.path.realpath(path.parents[2])


def same_tree(tree: str, default: str | Path | None) -> bool:
    """True when `tree` is the default tree (or either is unknown)."""
    if not tree or default is None or str(default) == "":
        return True
    return tree == os.path.realpath(default)


def short_name(tree: str) -> str:
    """`projB` for /data/projB/nnUNet_results, `results_b` for /data/results_b."""
    path = Path(tree)
    name = path.name
    if name.lower() in GENERIC_NAMES and path.parent.name:
        name = path.parent.name
    if len(name) > MAX_LABEL:
        name = name[: MAX_LABEL - 1] + "…"
    return name or tree


def tree_label(tree: str, default: str | Path | None) -> str:
    """'' for the default tree, else its short name: what a row of another tree shows."""
    return "" if same_tree(tree, default) else short_name(tree)


@dataclass(frozen=True, order=True)
class RunIdentity:
    results: str
    dataset: str
    trainer: str
    plans: str
    configuration: str
    fold: str


def split_run_dir(run_dir: str) -> tuple[str, str, str]:
    """(trainer, plans, configuration) from results/DatasetNNN_Name/T__P__C/fold_F."""
    parts = Path(run_dir).parent.name.split("__")
    return (parts[0], parts[1], "__".join(parts[2:])) if len(parts) >= 3 else ("?", "?", "?")


def run_identity(job: Any) -> RunIdentity:
    """The identity of a job's run (a Job or anything with its fields)."""
    trainer, plans, configuration = split_run_dir(str(job.run_dir or ""))
    return RunIdentity(results_tree(str(job.run_dir or "")), job.dataset, trainer, plans,
                       job.configuration or configuration, job.fold)  # fmt: skip


def watched_roots(
    default: str | Path, jobs: Iterable[Any] = (), known: Iterable[str] = ()
) -> list[Path]:
    """The results trees a command looks in: the default one (flags, `nnUNet_results`, else
    ./nnui_data/results), then the trees of the jobs it knows (the registry's), then those
    runs started by hand were seen in (`known`), each once, the default first."""
    roots = [Path(default)]
    seen = {os.path.realpath(default)}
    trees = [results_tree(str(getattr(job, "run_dir", "") or "")) for job in jobs]
    for tree in [*trees, *known]:
        if tree and tree not in seen and os.path.isdir(tree):
            seen.add(tree)
            roots.append(Path(tree))
    return roots


def roots_hint(roots: Iterable[str | Path]) -> str:
    """What a command that found nothing says: where it looked and how to look elsewhere."""
    looked = ", ".join(str(r) for r in roots) or "none"
    return (
        f"looked in the results tree(s) {looked}; point elsewhere with --results DIR "
        "or nnUNet_results=DIR"
    )
