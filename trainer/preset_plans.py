"""`nnui-preprocess DATASET -pl nnUNetPlannerResEnc{M,L,XL}`: a preset's plans file beside the
default plans, on the default plans' data.

A preset changes the patch, batch and network only; the spacing and normalisation are the
default plans', so its configurations read `nnuiPlans_<config>/` (as nnU-Net's presets read
`nnUNetPlans_<config>/`). When that data is there and was made from the stored fingerprint
for the current cases, only `<preset plans>.json` is written; otherwise nnui-preprocess
makes the default data first. nnU-Net's own preset files (`nnUNetResEncUNet*Plans.json`)
have other names and are never written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from trainer.data.planning import Overrides, plan_experiment
from trainer.data.raw import RawDataset, open_raw_dataset
from trainer.data.resenc_planning import PRESETS, plan_preset
from trainer.plans import (
    Plans,
    content_to_json,
    merge_plans,
    plans_file,
    plans_from_dict,
    read_plans_json,
)
from trainer.schema import DEFAULT_PLANS, FINGERPRINT_FILE, atomic_write_text, find_dataset

DEFAULT_PLANNER = "ExperimentPlanner"  # nnU-Net's name for its default planner
PLANNERS = (DEFAULT_PLANNER, *PRESETS)
_SAME_PREPROCESSING = ("spacing", "normalization_schemes", "use_mask_for_norm")
_SAME_DATASET = ("labels", "num_input_channels", "foreground_intensity_properties")


def _read_fingerprint(out_dir: Path) -> dict | None:
    try:
        data = json.loads((out_dir / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _default_plans(out_dir: Path) -> Plans | None:
    content = read_plans_json(plans_file(out_dir))
    try:
        return plans_from_dict(content) if content else None
    except (ValueError, KeyError, TypeError):
        return None


def _cases_present(folder: Path, case_ids: Iterable[str]) -> bool:
    return all((folder / f"{case}.json").is_file() for case in case_ids)


def missing_data(
    out_dir: Path, raw: RawDataset, configurations: tuple[str, ...]
) -> tuple[str, ...]:
    """The requested configurations whose default data cannot be shared: absent, incomplete,
    of other cases, or preprocessed otherwise than the stored fingerprint plans it now
    (all of them when the fingerprint or the default plans are unreadable or changed)."""
    fingerprint, default = _read_fingerprint(out_dir), _default_plans(out_dir)
    try:
        expected = plan_experiment(fingerprint or {}, raw.dataset_json, raw.name, configurations)
    except (ValueError, KeyError, TypeError, IndexError):
        return configurations
    if default is None or any(getattr(default, f) != getattr(expected, f) for f in _SAME_DATASET):
        return configurations
    case_ids = tuple(sorted(case.case_id for case in raw.cases))
    missing = []
    for name in configurations:
        have, want = default.configurations.get(name), expected.configurations[name]
        if (
            have is None
            or have.case_ids != case_ids
            or any(getattr(have, f) != getattr(want, f) for f in _SAME_PREPROCESSING)
            or not _cases_present(out_dir / have.data_identifier, case_ids)
        ):
            missing.append(name)
    return tuple(missing)


def write_preset_plans(out_dir: Path, raw: RawDataset, planner: str,
                       configurations: tuple[str, ...], overrides: Overrides | None,
                       fingerprint: dict) -> Plans:  # fmt: skip
    """Plan the preset from the stored fingerprint and write its plans file (other
    configurations already in it are kept, as nnui-preprocess keeps them)."""
    plans = plan_preset(fingerprint, raw.dataset_json, raw.name, planner, configurations, overrides)
    case_ids = tuple(sorted(case.case_id for case in raw.cases))
    written = {n: replace(c, case_ids=case_ids) for n, c in plans.configurations.items()}
    plans = replace(plans, configurations=written)
    path = plans_file(out_dir, plans.plans_name)
    content, _ = merge_plans(plans, read_plans_json(path))
    atomic_write_text(path, content_to_json(content))
    return plans_from_dict(content)


def preprocess_preset(raw_root: Path, preprocessed_root: Path, dataset: str,
                      configurations: tuple[str, ...], num_processes: int, planner: str,
                      overrides: Overrides | None, progress: Callable[[str], None],
                      make_default_data: Callable[..., object]) -> Plans:  # fmt: skip
    """The preset's plans; `make_default_data` (nnui-preprocess's pipeline) runs first
    when the default data it shares is missing or out of date."""
    name = find_dataset(Path(raw_root), dataset)
    raw = open_raw_dataset(Path(raw_root) / name)
    out_dir = Path(preprocessed_root) / name
    missing = missing_data(out_dir, raw, configurations)
    if not missing:
        progress(f"{planner}: reusing the {DEFAULT_PLANS} data (same spacing and normalisation)")
    for _ in range(2):  # twice: changed raw data drops the other configurations' data too
        if missing:
            progress(f"{planner} uses the {DEFAULT_PLANS} data of {', '.join(missing)}, "
                     "missing or out of date: making it")  # fmt: skip
            run = (raw_root, preprocessed_root, dataset, missing, num_processes)
            make_default_data(*run, progress=progress)
            missing = missing_data(out_dir, raw, configurations)
    assert not missing, "the default data was just written"
    fingerprint = _read_fingerprint(out_dir)
    assert fingerprint is not None
    return write_preset_plans(out_dir, raw, planner, configurations, overrides, fingerprint)
