"""Datasets for the launch picker: configurations from plans JSON, fold states from results.

JSON only (never the trainer's heavy modules), so the TUI starts fast.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.legacy import old_plans_identifiers
from app.services.launch.engines import NNUI, Engine
from trainer.schema.status import read_status
from trainer.schema.tree import DEFAULT_PLANS, Roots, plans_file_name
from trainer.schema.tree import list_datasets as dataset_names

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConfigurationInfo:
    name: str
    patch_size: tuple[int, ...]
    batch_size: int
    # nnU-Net's cascade: 3d_cascade_fullres trains on 3d_lowres's segmentations (its five
    # folds must be done first; trainer.data.cascade).
    previous_stage: str | None = None
    gpu_memory_gb: float | None = None  # the plans' estimate for the whole batch, if any


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    configurations: tuple[ConfigurationInfo, ...]
    results: dict[tuple[str, str], str]  # (configuration, fold) -> state from status.json
    plans: str = DEFAULT_PLANS  # the plans identifier its configurations come from

    def configuration(self, name: str) -> ConfigurationInfo | None:
        return next((c for c in self.configurations if c.name == name), None)


def read_configurations(
    folder: Path, plans_file: str = plans_file_name(DEFAULT_PLANS)
) -> tuple[ConfigurationInfo, ...]:
    """Configurations of one plans file (nnui's by default; nnU-Net's for its engine)."""
    path = folder / plans_file
    if not path.is_file():
        return ()
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        log.warning("cannot read %s: %s", path, error)
        return ()
    result = []
    blocks = data.get("configurations") or {}
    for name, config in blocks.items():
        if not isinstance(config, dict):
            continue
        parent = blocks.get(config.get("inherits_from"))  # 3d_cascade_fullres: 3d_fullres's
        if isinstance(parent, dict):
            config = {**parent, **config}
        try:
            patch = tuple(int(v) for v in config.get("patch_size", ()))
            batch = int(config.get("batch_size", 0))
            memory = config.get("gpu_memory_estimate_gb")
            memory = float(memory) if isinstance(memory, (int, float)) else None
        except (TypeError, ValueError):
            continue
        previous = config.get("previous_stage")
        if batch > 0:
            result.append(ConfigurationInfo(name, patch, batch, previous or None, memory))
    return tuple(result)


def _fold_states(results_dataset: Path, plans: str | None = None) -> dict[tuple[str, str], str]:
    """(configuration, fold) -> state, of every run folder (of the `plans` ones if given)."""
    states: dict[tuple[str, str], str] = {}
    if not results_dataset.is_dir():
        return states
    for trainer_dir in sorted(results_dataset.iterdir()):
        parts = trainer_dir.name.split("__")
        if len(parts) != 3 or not trainer_dir.is_dir():
            continue
        if plans is not None and parts[1] != plans:
            continue
        configuration = parts[2]
        for fold_dir in sorted(trainer_dir.glob("fold_*")):
            status = read_status(fold_dir)
            if status is not None:
                states[(configuration, fold_dir.name.removeprefix("fold_"))] = status.state
    return states


def first_step(roots: Roots) -> str:
    """What a user with no preprocessed nnui dataset should run next: the demo data when
    the raw root holds no dataset, `nnui-preprocess` of the first raw dataset otherwise."""
    raw = [n for n in dataset_names(roots.raw) if (roots.raw / n / "dataset.json").is_file()]
    if not raw:
        return (
            f"no raw data in {roots.raw}: run nnui-demo-data for a demo dataset, "
            "or put a DatasetNNN_Name folder (nnU-Net's layout) there"
        )
    first_id = raw[0].removeprefix("Dataset").split("_", 1)[0]
    more = f" (and {len(raw) - 1} more)" if len(raw) > 1 else ""
    return (
        f"raw data not preprocessed: {raw[0]}{more} in {roots.raw}; "
        f"run nnui-preprocess {first_id} -c 2d 3d_fullres"
    )


def list_datasets(
    roots: Roots, plans_file: str = plans_file_name(DEFAULT_PLANS)
) -> list[DatasetInfo]:
    infos = []
    for name in dataset_names(roots.preprocessed):
        infos.append(
            DatasetInfo(
                name=name,
                configurations=read_configurations(roots.preprocessed / name, plans_file),
                results=_fold_states(roots.results / name),
            )
        )
    return infos


def plans_identifiers(folder: Path, chosen: Engine) -> list[str]:
    """The plans identifiers of an engine in one preprocessed dataset folder, its default
    first: nnU-Net's `nnUNet*Plans*.json` (nnUNetPlans, nnUNetResEncUNetLPlans, ...) or
    nnui's `nnui*Plans*.json` (and nnui 0.1's `plans.json`, whose identifier is nnUNetPlans)."""
    try:
        names = {p.stem for p in folder.glob(chosen.plans_glob) if p.is_file()}
        if chosen.name == NNUI:
            names |= old_plans_identifiers(folder)  # app/legacy.py
    except OSError as error:
        log.warning("cannot list plans in %s: %s", folder, error)
        return []
    return sorted(names, key=lambda name: (name != chosen.default_plans, name))


def list_engine_datasets(roots: Roots, chosen: Engine) -> list[DatasetInfo]:
    """One entry per (dataset, plans) of the engine: what the launch picker lists."""
    infos = []
    for name in dataset_names(roots.preprocessed):
        folder = roots.preprocessed / name
        for plans in plans_identifiers(folder, chosen):
            configurations = read_configurations(folder, chosen.plans_file(plans))
            if configurations:
                states = _fold_states(roots.results / name, plans)
                infos.append(DatasetInfo(name, configurations, states, plans))
    return infos


def plans_batch_size(
    roots: Roots,
    dataset_name: str,
    configuration: str,
    plans_file: str = plans_file_name(DEFAULT_PLANS),
) -> int | None:
    for config in read_configurations(roots.preprocessed / dataset_name, plans_file):
        if config.name == configuration:
            return config.batch_size
    return None


GIB = 1024**3


def memory_check(
    config: ConfigurationInfo | None, gpus: list[str], snapshot: Any
) -> tuple[str | None, str | None]:
    """(the configuration's estimated GPU memory beside the chosen GPUs' free memory, a
    warning with the numbers when a GPU has less free). The plans' estimate is nnU-Net's
    (feature-map voxels scaled to its 8 GB reference) for the whole batch; DDP splits the
    batch over the GPUs."""
    if config is None or config.gpu_memory_gb is None or not gpus:
        return None, None
    share = math.ceil(config.batch_size / len(gpus)) / config.batch_size
    need = config.gpu_memory_gb * share
    free = {}
    for gpu in gpus:
        reading = snapshot.gpu(gpu) if snapshot is not None and gpu.isdigit() else None
        used = getattr(reading, "memory_used_bytes", None)
        total = getattr(reading, "memory_total_bytes", None)
        if used is not None and total:
            free[gpu] = (total - used) / GIB
    shown = ", ".join(f"GPU {g} {v:.1f} GB free" for g, v in free.items())
    line = (
        f"{config.name} needs about {need:.1f} GB per GPU (nnU-Net's estimate, batch "
        f"{config.batch_size}); {shown or 'free memory unknown'}"
    )
    short = [f"GPU {g} has {v:.1f} GB free" for g, v in free.items() if v < need]
    if not short:
        return line, None
    return line, f"{config.name} needs about {need:.1f} GB per GPU but {', '.join(short)}"
