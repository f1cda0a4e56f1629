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

from trainer.data.raw import RawDataset, open_raw_dataset
from trainer.planning.cpu import plan_cpu
from trainer.planning.plans import (
    Plans,
    content_to_json,
    merge_plans,
    plans_file,
    plans_from_dict,
    read_plans_json,
)
from trainer.planning.resenc import PRESETS, SHARED_CONFIGURATIONS, plan_preset
from trainer.planning.rules import (
    CPU_PLANNER,
    CPU_PLANS,
    DEFAULT_PLANNER,
    Overrides,
    PlannerOptions,
    PlanningError,
    check_options,
    plan_experiment,
)
from trainer.schema.atomic import atomic_write_text
from trainer.schema.tree import DEFAULT_PLANS, FINGERPRINT_FILE, find_dataset

PLANNERS = (DEFAULT_PLANNER, CPU_PLANNER, *PRESETS)


def make_plans(options: PlannerOptions, fingerprint: dict, dataset_json: dict, name: str,
               configurations: tuple[str, ...] | None,
               overrides: Overrides | None) -> Plans:  # fmt: skip
    """The plans of `options.planner` for `configurations` (None: every one it makes);
    PlanningError when one asked for is not among those the planner makes."""
    check_options(options)
    run = (fingerprint, dataset_json, name, configurations, overrides)
    plans = _plan(options, *run)
    absent = [c for c in configurations or () if c not in plans.configurations]
    if absent:
        every = _plan(options, fingerprint, dataset_json, name, None, None)
        made = ", ".join(sorted(every.configurations))
        raise PlanningError(
            f"nnU-Net's planner makes no {', '.join(absent)} for {name} (it makes: {made}; "
            "no 3d for 2D data, a 3d_lowres only for large images)"
        )
    return plans


def _plan(options: PlannerOptions, fingerprint: dict, dataset_json: dict, name: str,
          configurations: tuple[str, ...] | None,
          overrides: Overrides | None) -> Plans:  # fmt: skip
    if options.planner in PRESETS:  # its 3d_lowres: data of its own (preprocess_preset)
        run = (fingerprint, dataset_json, name, options.planner, configurations, overrides)
        return plan_preset(*run, options)
    if options.planner == CPU_PLANNER:
        cpu = (fingerprint, dataset_json, name, configurations, overrides)
        return plan_cpu(*cpu, options.plans_name or CPU_PLANS, options.target_spacing)
    return plan_experiment(fingerprint, dataset_json, name, configurations, overrides,
                           options=options)  # fmt: skip


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
    out_dir: Path, raw: RawDataset, configurations: tuple[str, ...], options: PlannerOptions
) -> tuple[str, ...]:
    """The requested configurations whose default data cannot be shared: absent, incomplete,
    of other cases, or preprocessed otherwise than the stored fingerprint plans it now
    (all of them when the fingerprint or the default plans are unreadable or changed)."""
    fingerprint, have_default = _read_fingerprint(out_dir), _default_plans(out_dir)
    try:
        default = PlannerOptions(target_spacing=options.target_spacing)
        run = (fingerprint or {}, raw.dataset_json, raw.name, configurations, None)
        expected = plan_experiment(*run, options=default)
    except (ValueError, KeyError, TypeError, IndexError):
        return configurations
    if have_default is None or any(
        getattr(have_default, f) != getattr(expected, f) for f in _SAME_DATASET
    ):
        return configurations
    case_ids = tuple(sorted(case.case_id for case in raw.cases))
    missing = []
    for name in configurations:
        have, want = have_default.configurations.get(name), expected.configurations.get(name)
        if want is None:
            continue  # the default planner makes no such configuration (2D data: no 3d)
        if (
            have is None
            or have.case_ids != case_ids
            or any(getattr(have, f) != getattr(want, f) for f in _SAME_PREPROCESSING)
            or not _cases_present(out_dir / have.data_identifier, case_ids)
        ):
            missing.append(name)
    return tuple(missing)


def write_preset_plans(out_dir: Path, raw: RawDataset, options: PlannerOptions,
                       configurations: tuple[str, ...], overrides: Overrides | None,
                       fingerprint: dict) -> Plans:  # fmt: skip
    """Plan the preset from the stored fingerprint and write its plans file (other
    configurations already in it are kept, as nnui-preprocess keeps them)."""
    run = (fingerprint, raw.dataset_json, raw.name, options.planner, configurations, overrides)
    plans = plan_preset(*run, options)
    case_ids = tuple(sorted(case.case_id for case in raw.cases))
    written = {n: replace(c, case_ids=case_ids) for n, c in plans.configurations.items()}
    plans = replace(plans, configurations=written)
    path = plans_file(out_dir, plans.plans_name)
    content, _ = merge_plans(plans, read_plans_json(path))
    atomic_write_text(path, content_to_json(content))
    return plans_from_dict(content)


def preprocess_preset(raw_root: Path, preprocessed_root: Path, dataset: str,
                      configurations: tuple[str, ...] | None, num_processes: int,
                      options: PlannerOptions, overrides: Overrides | None,
                      progress: Callable[[str], None],
                      make_default_data: Callable[..., Plans | None]) -> Plans:  # fmt: skip
    """The preset's plans; `make_default_data` (nnui-preprocess's pipeline) runs first
    when the default data it shares is missing or out of date, and afterwards for the
    preset's own 3d_lowres data (`configurations` None: every one the preset makes)."""
    name = find_dataset(Path(raw_root), dataset)
    raw = open_raw_dataset(Path(raw_root) / name)
    shared = tuple(c for c in configurations or SHARED_CONFIGURATIONS if c in SHARED_CONFIGURATIONS)
    plans = None
    if shared:
        run = (raw_root, preprocessed_root, raw, shared, num_processes, options)
        plans = _shared_preset_plans(*run, overrides, progress, make_default_data)
    if configurations is None or "3d_lowres" in configurations:
        fingerprint = _read_fingerprint(Path(preprocessed_root) / name) or {}
        every = plan_preset(fingerprint, raw.dataset_json, name, options.planner, None, None,
                            options)  # fmt: skip
        if "3d_lowres" in every.configurations or configurations is not None:
            lowres = (raw_root, preprocessed_root, dataset, ("3d_lowres",), num_processes)
            plans = make_default_data(*lowres, overrides, progress=progress, options=options)
    assert plans is not None
    return plans


def _shared_preset_plans(raw_root: Path, preprocessed_root: Path, raw: RawDataset,
                         configurations: tuple[str, ...], num_processes: int,
                         options: PlannerOptions, overrides: Overrides | None,
                         progress: Callable[[str], None],
                         make_default_data: Callable[..., Plans | None]) -> Plans:  # fmt: skip
    """The preset's 2d/3d_fullres plans on the default plans' data (made when missing)."""
    planner, name, dataset = options.planner, raw.name, raw.name
    out_dir = Path(preprocessed_root) / name
    missing = missing_data(out_dir, raw, configurations, options)
    if not missing:
        progress(f"{planner}: reusing the {DEFAULT_PLANS} data (same spacing and normalisation)")
    for _ in range(2):  # twice: changed raw data drops the other configurations' data too
        if missing:
            progress(f"{planner} uses the {DEFAULT_PLANS} data of {', '.join(missing)}, "
                     "missing or out of date: making it")  # fmt: skip
            run = (raw_root, preprocessed_root, dataset, missing, num_processes)
            default = PlannerOptions(target_spacing=options.target_spacing)
            make_default_data(*run, progress=progress, options=default)
            missing = missing_data(out_dir, raw, configurations, options)
    assert not missing, "the default data was just written"
    fingerprint = _read_fingerprint(out_dir)
    assert fingerprint is not None
    return write_preset_plans(out_dir, raw, options, configurations, overrides, fingerprint)
