"""`nnui-find-best-configuration DATASET -c 2d 3d_fullres [-f 0 1 2 3 4]`: which
configuration (or ensemble of two) segments the cross-validation best, and whether keeping
only the largest connected component of a label helps (nnU-Net's postprocessing).

Reads each fold's `validation/CASE.npz` (probabilities in the raw geometry: train with
--npz) and scores against the raw `labelsTr`, on the union of the folds' validation cases.
Writes, under the dataset's results folder, `nnui_inference_information.json` (the
figures, the choice, the exact commands) and `nnui_postprocessing.json` (for --postprocess).
nnui's own names: nnU-Net's `inference_information.json` beside them is never touched.
"""

from __future__ import annotations

import itertools
import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.cli import OneLineParser, one_line, usage_error
from trainer.data.image_io import ImageReadError, read_image
from trainer.data.labels import LabelSpec, from_dataset_json
from trainer.evaluation.evaluate import case_metrics, summarize
from trainer.inference.postprocess import POSTPROCESSING_KEY, Step, keep_largest_component
from trainer.schema.atomic import atomic_write_text
from trainer.schema.exits import EXIT_OK
from trainer.schema.tree import (
    DEFAULT_PLANS,
    DEFAULT_TRAINER,
    VALIDATION_DIR,
    find_dataset,
    resolve_roots,
    run_dir,
)

INFO_FILE = "nnui_inference_information.json"
POSTPROCESSING_FILE = "nnui_postprocessing.json"


class SelectionError(ValueError):
    """A user mistake (one line; the CLI exits 2)."""


@dataclass(frozen=True)
class Inputs:
    dataset_name: str
    spec: LabelSpec  # labels, regions (sigmoid, regions_class_order) and the ignore label
    references: dict[str, Path]  # case id -> raw label file
    probabilities: dict[str, dict[str, Path]]  # configuration -> case id -> CASE.npz


def _validation_npz(
    results: Path, name: str, config: str, folds: Sequence[str], trainer: str, plans: str
) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for fold in folds:
        folder = run_dir(results, name, config, fold, trainer, plans) / VALIDATION_DIR
        files = sorted(folder.glob("*.npz")) if folder.is_dir() else []
        if not files:
            raise SelectionError(
                f"{config} fold {fold} has no validation probabilities in {folder}: train with "
                f"--npz, or run nnui-train {name} {config} {fold} --val --npz"
            )
        found.update({path.stem: path for path in files})
    return found


def collect(
    raw: Path,
    results: Path,
    dataset: str,
    configurations: Sequence[str],
    folds: Sequence[str],
    trainer: str,
    plans: str,
) -> Inputs:
    name = find_dataset(raw, dataset)
    try:
        dataset_json = json.loads((raw / name / "dataset.json").read_text())
        spec = from_dataset_json(dataset_json)
        ending = dataset_json["file_ending"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SelectionError(
            f"{raw / name / 'dataset.json'} is unreadable ({one_line(exc)})"
        ) from None
    probabilities = {
        c: _validation_npz(results, name, c, folds, trainer, plans) for c in configurations
    }
    cases = set(probabilities[configurations[0]])
    for config in configurations[1:]:
        differ = sorted(cases ^ set(probabilities[config]))
        if differ:
            raise SelectionError(
                f"{config} and {configurations[0]} validated different cases (first: {differ[0]})"
            )
    references = {c: raw / name / "labelsTr" / f"{c}{ending}" for c in sorted(cases)}
    for case_id, path in references.items():
        if not path.is_file():
            raise SelectionError(f"validation case {case_id} has no label {path}")
    return Inputs(name, spec, references, probabilities)


def _segmentation(
    inputs: Inputs, configs: Sequence[str], case_id: str, largest: Sequence[Step]
) -> np.ndarray:
    total = None
    for config in configs:
        with np.load(inputs.probabilities[config][case_id]) as archive:
            probs = archive["probabilities"].astype(np.float64)
        total = probs if total is None else total + probs
    assert total is not None
    segmentation = inputs.spec.to_segmentation(total / len(configs))
    if not largest:
        return segmentation
    return keep_largest_component(segmentation, [_as_step(s) for s in largest])


def score(inputs: Inputs, configs: Sequence[str], largest: Sequence[Step] = ()) -> dict[str, Any]:
    """summary.json content of one candidate (one case in memory at a time)."""
    foreground = inputs.spec.foreground_keys  # label values, or regions
    per_case = []
    for case_id, ref_path in inputs.references.items():
        try:
            reference = read_image(ref_path)[0]
        except ImageReadError as exc:
            raise SelectionError(str(exc)) from None
        prediction = _segmentation(inputs, configs, case_id, largest)
        per_case.append(
            {
                "reference_file": str(ref_path),
                "prediction_file": case_id,
                "metrics": case_metrics(
                    reference, prediction, foreground, inputs.spec.ignore_label
                ),
            }
        )
    return summarize(per_case, foreground)


def _dice(summary: dict[str, Any]) -> float:
    value = summary["foreground_mean"]["Dice"]
    return -1.0 if value is None else float(value)


def _label_dice(summary: dict[str, Any], label: int) -> float:
    """A label's own Dice; with regions (metrics per region, not per label value) the mean
    foreground Dice stands in for it."""
    if str(label) not in summary["mean"]:
        return _dice(summary)
    value = summary["mean"][str(label)]["Dice"]
    return -1.0 if value is None else float(value)


def choose_postprocessing(
    inputs: Inputs, configs: Sequence[str], progress: Callable[[str], None]
) -> tuple[list, float]:
    """nnU-Net's choice: first all foreground as one component, kept if the mean foreground
    Dice rises and no label's Dice falls; then, with more than one foreground label, each
    label's largest component on top, kept if that label's own Dice rises."""
    foreground = [v for v in inputs.spec.output_values if v != 0]
    current = score(inputs, configs)
    kept: list = []
    whole = score(inputs, configs, [tuple(foreground)])
    better = _dice(whole) > _dice(current)
    if better and all(_label_dice(whole, v) >= _label_dice(current, v) for v in foreground):
        kept, current = [foreground], whole
    progress(f"largest foreground component: Dice {_dice(whole):.4f} ({'kept' if kept else 'no'})")
    if len(foreground) > 1:
        for label in foreground:
            candidate = score(inputs, configs, [*(_as_step(s) for s in kept), label])
            after, before = _label_dice(candidate, label), _label_dice(current, label)
            progress(f"largest component of label {label}: Dice {after:.4f} (was {before:.4f})")
            if after > before:
                kept, current = [*kept, label], candidate
    return kept, _dice(current)


def _as_step(step: int | list[int] | tuple[int, ...]) -> Step:
    return tuple(step) if isinstance(step, list) else step


def commands(info: dict[str, Any], pp_file: Path) -> list[str]:
    configs, folds = info["configurations"], info["folds"]
    pp = ["--postprocess", str(pp_file)] if info["largest_component_labels"] else []
    base = ["-i", "INPUT_FOLDER", "-d", info["dataset"], "-f", *folds]
    if info["trainer"] != DEFAULT_TRAINER:
        base += ["-tr", info["trainer"]]
    if info["plans"] != DEFAULT_PLANS:
        base += ["-p", info["plans"]]
    if len(configs) == 1:
        return [shlex.join(["nnui-predict", *base, "-o", "OUTPUT_FOLDER", "-c", configs[0], *pp])]
    lines = [
        shlex.join(
            ["nnui-predict", *base, "-o", f"OUTPUT_FOLDER_{c}", "-c", c, "--save_probabilities"]
        )
        for c in configs
    ]
    folders = [f"OUTPUT_FOLDER_{c}" for c in configs]
    lines.append(shlex.join(["nnui-ensemble", "-i", *folders, "-o", "OUTPUT_FOLDER", *pp]))
    return lines


def find_best(
    inputs: Inputs, configurations: Sequence[str], ensembles: bool, progress: Callable[[str], None]
) -> dict[str, Any]:
    candidates: list[tuple[str, ...]] = [(c,) for c in configurations]
    if ensembles:
        candidates += list(itertools.combinations(configurations, 2))
    figures = {}
    for configs in candidates:
        key = " + ".join(configs)
        figures[key] = _dice(score(inputs, configs))
        progress(f"{key}: mean foreground Dice {figures[key]:.4f}")
    best = max(candidates, key=lambda c: figures[" + ".join(c)])  # first wins ties
    baseline = figures[" + ".join(best)]
    largest, after = choose_postprocessing(inputs, best, progress)
    return {
        "mean_foreground_dice": figures,
        "configurations": list(best),
        "is_ensemble": len(best) > 1,
        "mean_foreground_dice_best": baseline,
        "largest_component_labels": largest,
        "mean_foreground_dice_after_postprocessing": after,
        "num_cases": len(inputs.references),
    }


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="nnui-find-best-configuration",
        description="Pick the configuration (or ensemble) and postprocessing of a dataset.",
    )
    parser.add_argument("dataset", help="dataset id or DatasetNNN_Name")
    parser.add_argument("-c", nargs="+", default=["2d", "3d_fullres"], help="configurations")
    parser.add_argument("-f", nargs="+", default=["0", "1", "2", "3", "4"], help="folds")
    parser.add_argument("-tr", default=DEFAULT_TRAINER)
    parser.add_argument("-p", default=DEFAULT_PLANS)
    parser.add_argument("--disable_ensembling", action="store_true")
    parser.add_argument("--raw", default=None, help="raw root (default $nnUNet_raw)")
    parser.add_argument("--results", default=None, help="results root (default $nnUNet_results)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    roots = resolve_roots(raw=args.raw, results=args.results)
    configs = list(dict.fromkeys(args.c))
    try:
        inputs = collect(roots.raw, roots.results, args.dataset, configs, args.f, args.tr, args.p)
        choice = find_best(inputs, configs, not args.disable_ensembling, print)
        out_dir = roots.results / inputs.dataset_name
        pp_file = out_dir / POSTPROCESSING_FILE
        info = {
            "dataset": inputs.dataset_name,
            "folds": list(args.f),
            "trainer": args.tr,
            "plans": args.p,
            **choice,
        }
        info["commands"] = commands(info, pp_file)
        pp = {POSTPROCESSING_KEY: choice["largest_component_labels"]}
        atomic_write_text(pp_file, json.dumps(pp, indent=1) + "\n")
        atomic_write_text(out_dir / INFO_FILE, json.dumps(info, indent=1) + "\n")
    except (SelectionError, ValueError, OSError) as exc:
        return usage_error(exc)
    print(
        f"best: {' + '.join(choice['configurations'])}; postprocessing labels "
        f"{choice['largest_component_labels']} -> {out_dir / INFO_FILE}"
    )
    for line in info["commands"]:
        print(line)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
