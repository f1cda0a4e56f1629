"""`nnui-preprocess DATASET`: fingerprint -> plans -> cropped, normalised, resampled .b2nd.

Completion marker: nnuiPlans.json. It is deleted when a run starts and written last, after
every case of every configuration, so a half-finished run never looks complete. Each case
writes CASE.b2nd and CASE_seg.b2nd (tmp name + rename) before CASE.json, so a listed case
is always whole.

One tree, two tools: everything written here has nnui's own names (nnuiPlans.json,
nnui_fingerprint.json, nnuiPlans_<config>/); dataset.json and splits_final.json are shared
with nnU-Net and only written when absent. nnU-Net's files are never touched.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import numpy as np

from trainer.cli import OneLineParser, usage_error
from trainer.data.case_ops import (
    crop,
    nonzero_bbox,
    normalize,
    resample_image,
    resample_seg,
    resampled_shape,
)
from trainer.data.labels import ANNOTATED_KEY, IGNORE, from_dataset_json, region_note
from trainer.data.raw import DataError, RawCase, RawDataset, load_raw_case, open_raw_dataset
from trainer.planning.fingerprint import fingerprint_dataset, run_all
from trainer.planning.plans import (
    Plans,
    content_to_json,
    merge_plans,
    plans_file,
    plans_from_dict,
    read_plans_json,
)
from trainer.planning.presets import CPU_PLANNER, PLANNERS, make_plans, preprocess_preset
from trainer.planning.resenc import PRESETS
from trainer.planning.rules import (
    CONFIGURATIONS,
    DEFAULT_PLANNER,
    Overrides,
    PlannerOptions,
    PlanningError,
    parse_overrides,
)
from trainer.planning.splits import NUM_FOLDS, load_or_create_splits
from trainer.schema.atomic import atomic_write_text
from trainer.schema.exits import EXIT_OK
from trainer.schema.nnunet import nnunet_files
from trainer.schema.tree import FINGERPRINT_FILE, DatasetNotFound, find_dataset, resolve_roots

# nnU-Net's rule for the stored foreground locations of a class: all of them up to
# MIN_CLASS_LOCATIONS, beyond that MIN_CLASS_LOCATIONS or 1 % of them, whichever is more.
MIN_CLASS_LOCATIONS = 10_000
CLASS_LOCATION_SHARE = 0.01

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaseJob:
    """Everything one worker needs for one case (plain data: it crosses processes)."""

    case: RawCase
    labels: dict[str, int]
    fallback_spacing: tuple[float, ...] | None
    fg_properties: list[dict[str, float]]
    configs: tuple[dict, ...]  # name, folder, spacing, patch_size, schemes, use_mask
    transpose: tuple[int, ...] = (0, 1, 2)  # the plans' transpose_forward


def class_location_count(num_voxels: int) -> int:
    """How many of a class's num_voxels locations are stored (nnU-Net's rule)."""
    return max(min(MIN_CLASS_LOCATIONS, num_voxels), math.ceil(num_voxels * CLASS_LOCATION_SHARE))


def sample_class_locations(
    seg: np.ndarray, values: list[int], seed: int, ignore: int | None = None
) -> dict[str, list]:
    """Random (z, y, x) voxels per foreground class, as many as class_location_count says,
    and, with an ignore label, of the annotated voxels (trainer.data.labels.ANNOTATED_KEY)."""
    rng = np.random.default_rng(seed)
    out = {}
    wanted = [(str(v), seg == v) for v in values]
    if ignore is not None:
        wanted.append((ANNOTATED_KEY, seg != ignore))
    for key, mask in wanted:
        coords = np.argwhere(mask)
        keep = class_location_count(len(coords))
        if len(coords) > keep:
            coords = coords[np.sort(rng.choice(len(coords), keep, replace=False))]
        out[key] = coords.astype(int).tolist()
    return out


def preprocess_case(job: CaseJob) -> dict:
    """Crop, normalise, resample and write one case for every configuration."""
    started = time.perf_counter()
    image, seg, spacing = load_raw_case(job.case, job.labels, job.fallback_spacing)
    if job.transpose != (0, 1, 2):  # stored as nnU-Net stores it: the plans' axis order
        image = np.ascontiguousarray(image.transpose(0, *(a + 1 for a in job.transpose)))
        seg = np.ascontiguousarray(seg.transpose(job.transpose))
        spacing = cast("tuple[float, float, float]", tuple(spacing[a] for a in job.transpose))
    bbox = nonzero_bbox(image)
    image_c, seg_c = crop(image, bbox), crop(seg, bbox)
    first = job.configs[0]
    normalized = normalize(
        image_c, first["schemes"], first["use_mask"], job.fg_properties, seg=seg_c
    )
    fg_values = sorted(v for name, v in job.labels.items() if v != 0 and name != IGNORE)
    shapes = {}
    for config in job.configs:
        target = tuple(config["spacing"])
        if config["name"] == "2d":  # 2d keeps each case's own slice spacing
            target = (spacing[0], *target[-2:])
        new_shape = resampled_shape(seg_c.shape, spacing, target)
        data = resample_image(normalized, new_shape, spacing, target)
        seg_r = resample_seg(seg_c, new_shape, spacing, target)
        folder = Path(config["folder"])
        patch = tuple(config["patch_size"])
        from trainer.data.blosc_io import write_array  # blosc2 only where it is needed

        write_array(folder / f"{job.case.case_id}.b2nd", data, patch)
        write_array(folder / f"{job.case.case_id}_seg.b2nd", seg_r[None].astype(np.uint8), patch)
        properties = {
            "case_id": job.case.case_id,
            "spacing": list(spacing),
            "shape_before_cropping": list(seg.shape),
            "bbox_used_for_cropping": bbox,
            "shape_after_cropping_and_before_resampling": list(seg_c.shape),
            "spacing_after_resampling": list(target),
            "shape_after_resampling": list(new_shape),
            "class_locations": sample_class_locations(
                seg_r, fg_values, zlib.crc32(job.case.case_id.encode()), job.labels.get(IGNORE)
            ),
        }
        if job.transpose != (0, 1, 2):  # what the export undoes (raw shapes: bbox, crop)
            properties["transpose_forward"] = list(job.transpose)
        atomic_write_text(folder / f"{job.case.case_id}.json", json.dumps(properties) + "\n")
        shapes[config["name"]] = tuple(new_shape)
    return {"case_id": job.case.case_id, "shapes": shapes, "time_s": time.perf_counter() - started}


def preprocess_dataset(
    raw_root: Path,
    preprocessed_root: Path,
    dataset: str,
    configurations: tuple[str, ...] | None = None,
    num_processes: int = 1,
    overrides: Overrides | None = None,
    verify_only: bool = False,
    progress: Callable[[str], None] = log.info,
    planner: str = DEFAULT_PLANNER,
    options: PlannerOptions | None = None,
) -> Plans | None:
    """The whole pipeline; returns the plans (None with verify_only). `configurations`
    None: every one the planner makes. A preset planner (`-pl nnUNetPlannerResEncM`) writes
    its plans on the default plans' data. `options` (nnU-Net's planner flags) replace
    `planner` when given.

    Raises DatasetNotFound, DataError or PlanningError for user mistakes.
    """
    options = options or PlannerOptions(planner)
    # A preset's 3d_lowres has data of its own: the pipeline below makes it.
    if options.planner in PRESETS and not verify_only and configurations != ("3d_lowres",):
        run = (raw_root, preprocessed_root, dataset, configurations, num_processes)
        return preprocess_preset(*run, options, overrides, progress, preprocess_dataset)
    name = find_dataset(Path(raw_root), dataset)
    raw = open_raw_dataset(Path(raw_root) / name)
    note = region_note(from_dataset_json(raw.dataset_json))
    if note:
        progress(note)
    # One progress line per case: per case for --verify, per case of the writing pass else.
    fingerprint = fingerprint_dataset(raw, num_processes, progress, per_case=verify_only)
    if verify_only:
        return None
    plans = make_plans(options, fingerprint, raw.dataset_json, name, configurations, overrides)
    out_dir = Path(preprocessed_root) / name
    _prepare_output_dir(out_dir, plans, progress)
    existing = _write_interim_plans(out_dir, plans, dataset, progress)
    _write_dataset_files(out_dir, raw, fingerprint)
    configs = _clear_config_folders(out_dir, plans)
    _preprocess_cases(raw, fingerprint, configs, num_processes, progress, plans.transpose[0])
    return _write_final_plans(out_dir, plans, existing, [c.case_id for c in raw.cases], progress)


def _prepare_output_dir(out_dir: Path, plans: Plans, progress: Callable[[str], None]) -> None:
    _refuse_nnunet_data_folders(out_dir, plans)
    out_dir.mkdir(parents=True, exist_ok=True)
    if nnunet_files(out_dir):
        progress(
            f"{out_dir} also holds nnU-Net's files: they are left untouched; nnui writes only "
            f"{plans.plans_name}.json, {FINGERPRINT_FILE} and {plans.plans_name}_<config>/ there"
        )


def _write_interim_plans(
    out_dir: Path, plans: Plans, dataset: str, progress: Callable[[str], None]
) -> dict | None:
    """Returns the plans.json found before this run (merged into the final one)."""
    # Other configurations already in plans.json stay (same bytes, same identity). While
    # this run works, plans.json lists only them: the requested ones are not complete yet.
    existing = read_plans_json(plans_file(out_dir, plans.plans_name))
    merged, dropped = merge_plans(plans, existing)
    new = {*plans.configurations, *plans.cascades}
    others = {k: v for k, v in merged["configurations"].items() if k not in new}
    kept = {**merged, "configurations": others}
    for other in dropped:
        progress(
            f"{other} dropped from plans.json: the raw data changed since it was preprocessed; "
            f"run nnui-preprocess {dataset} -c {other} again"
        )
    if kept["configurations"]:
        atomic_write_text(plans_file(out_dir, plans.plans_name), content_to_json(kept))
    else:
        plans_file(out_dir, plans.plans_name).unlink(missing_ok=True)  # incomplete until rewritten
    return existing


def _write_dataset_files(out_dir: Path, raw: RawDataset, fingerprint: dict) -> None:
    if not (out_dir / "dataset.json").exists():  # shared with nnU-Net: never replaced
        atomic_write_text(out_dir / "dataset.json", json.dumps(raw.dataset_json, indent=2) + "\n")
    atomic_write_text(out_dir / FINGERPRINT_FILE, json.dumps(fingerprint, indent=1) + "\n")


def _clear_config_folders(out_dir: Path, plans: Plans) -> tuple[dict, ...]:
    """Empty each requested configuration's data folder; returns what the case jobs need."""
    configs = []
    for config in plans.configurations.values():
        folder = out_dir / config.data_identifier
        folder.mkdir(exist_ok=True)
        for stale in [*folder.glob("*.b2nd"), *folder.glob("*.json"), *folder.glob(".*.tmp")]:
            stale.unlink()
        configs.append(
            {
                "name": config.name,
                "folder": str(folder),
                "spacing": config.spacing,
                "patch_size": config.patch_size,
                "schemes": config.normalization_schemes,
                "use_mask": config.use_mask_for_norm,
            }
        )
    return tuple(configs)


def _preprocess_cases(
    raw: RawDataset,
    fingerprint: dict,
    configs: tuple[dict, ...],
    num_processes: int,
    progress: Callable[[str], None],
    transpose: tuple[int, ...] = (0, 1, 2),
) -> None:
    fg = [
        fingerprint["foreground_intensity_properties_per_channel"][str(c)]
        for c in range(raw.num_channels)
    ]
    jobs = [
        (CaseJob(case, raw.labels, raw.fallback_spacing, fg, configs, transpose),)
        for case in raw.cases
    ]
    total = len(jobs)

    def done(i: int, result: dict) -> None:
        shapes = " ".join(f"{k} {list(v)}" for k, v in result["shapes"].items())
        progress(
            f"[preprocess {i + 1}/{total}] {result['case_id']} {shapes} {result['time_s']:.1f} s"
        )

    run_all(preprocess_case, jobs, num_processes, done)


def _write_final_plans(
    out_dir: Path,
    plans: Plans,
    existing: dict | None,
    case_ids: list[str],
    progress: Callable[[str], None],
) -> Plans:
    """Splits, then plans.json: written last, it is the completion marker."""
    splits = load_or_create_splits(out_dir, case_ids)
    if len(splits) < NUM_FOLDS:
        progress(f"only {len(case_ids)} cases: {len(splits)} folds instead of {NUM_FOLDS}")
    written = {
        n: replace(c, case_ids=tuple(sorted(case_ids))) for n, c in plans.configurations.items()
    }
    content, _ = merge_plans(replace(plans, configurations=written), existing)
    path = plans_file(out_dir, plans.plans_name)
    atomic_write_text(path, content_to_json(content))  # the completion marker
    return plans_from_dict(content)


class SharedTreeError(ValueError):
    """Writing would replace or delete files that nnU-Net made."""


def _refuse_nnunet_data_folders(out_dir: Path, plans: Plans) -> None:
    """Before anything is written: a data folder of ours must not hold nnU-Net's files
    (its stale-file sweep would delete them)."""
    for config in plans.configurations.values():
        folder = out_dir / config.data_identifier
        theirs = nnunet_files(folder)
        if theirs:
            raise SharedTreeError(
                f"{folder} holds nnU-Net's files ({', '.join(theirs)}); nnui will not write "
                "there: move them away or use another plans identifier"
            )


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="nnui-preprocess", description="Fingerprint, plan and preprocess a raw dataset."
    )
    add = parser.add_argument
    add("dataset", help="dataset id (e.g. 900) or DatasetNNN_Name")
    add(
        "-c",
        nargs="+",
        default=None,
        choices=CONFIGURATIONS,
        help="configurations to plan and preprocess (default: all the planner makes)",
    )
    add("--verify", action="store_true", help="only run the integrity checks")
    add("-np", type=int, default=min(4, os.cpu_count() or 1), help="processes")
    add("--raw", default=None, help="raw root (default $nnUNet_raw)")
    add("--preprocessed", default=None, help="default $nnUNet_preprocessed")
    add("--patch-size", type=int, nargs="+", help="e.g. 48 64 64 (3d) or 64 64 (2d)")
    add("--batch-size", nargs="+", help="N for all, or CONFIG=N (e.g. 2d=16)")
    add(
        "-pl",
        default=DEFAULT_PLANNER,
        choices=PLANNERS,
        metavar="PLANNER",
        help=f"{DEFAULT_PLANNER} (default: nnU-Net's plans), {CPU_PLANNER} (small plans a CPU "
        "trains, written as nnuiCPUPlans), nnUNetPlannerResEnc{M,L,XL} (residual-encoder "
        "presets nnuiResEncUNet{M,L,XL}Plans on the default plans' data)",
    )
    add(
        "-gpu_memory_target",
        type=float,
        default=None,
        metavar="GB",
        help="GPU memory the plans are sized for (default 8; presets 8/24/40)",
    )
    add(
        "-overwrite_target_spacing",
        type=float,
        nargs=3,
        default=None,
        metavar="S",
        help="target spacing (z y x, before the transpose) instead of the planned one",
    )
    add(
        "-overwrite_plans_name",
        default=None,
        metavar="NAME",
        help="plans identifier instead of the planner's (nnuiPlans, nnuiCPUPlans, ...)",
    )
    return parser  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    roots = resolve_roots(raw=args.raw, preprocessed=args.preprocessed)
    started = time.perf_counter()
    configs = tuple(args.c) if args.c else None
    try:
        overrides = parse_overrides(args.patch_size, args.batch_size, configs or CONFIGURATIONS)
        options = PlannerOptions(args.pl, args.overwrite_plans_name, args.gpu_memory_target,
                                 args.overwrite_target_spacing)  # fmt: skip
        plans = preprocess_dataset(
            roots.raw, roots.preprocessed, args.dataset, configs, max(1, args.np), overrides,
            args.verify, progress=lambda line: print(line, flush=True), options=options,
        )  # fmt: skip
    except (DatasetNotFound, DataError, PlanningError, SharedTreeError) as exc:
        return usage_error(exc)
    except OSError as exc:  # e.g. a read-only or full output disk
        return usage_error(exc)
    elapsed = time.perf_counter() - started
    if plans is None:
        print(f"verified {args.dataset}: all cases ok ({elapsed:.1f} s)")
        return EXIT_OK
    for config in plans.configurations.values():
        print(
            f"{config.name}: patch {list(config.patch_size)} batch {config.batch_size} "
            f"spacing {[round(s, 3) for s in config.spacing]} stages {config.network.num_stages}"
        )
    print(f"done in {elapsed:.1f} s -> {roots.preprocessed / plans.dataset_name}")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
