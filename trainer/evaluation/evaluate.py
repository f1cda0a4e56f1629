"""`nnui-evaluate REF_DIR PRED_DIR [-l 1 2] [-o summary.json]`: segmentation metrics of
two folders, in nnU-Net's `summary.json` layout.

Per case and label: Dice, IoU, TP, FP, FN, TN, n_pred, n_ref (`metric_per_case`, each with
`reference_file`, `prediction_file`, `metrics`); `mean`: per label, the mean over cases
(cases where a metric is undefined are skipped); `foreground_mean`: the mean over the
labels' means. As nnU-Net: Dice and IoU are undefined when the label is absent from
both reference and prediction, and `foreground_mean` is undefined when a label's mean is.
Undefined values are written as null (strict JSON) where nnU-Net writes NaN.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from trainer.cli import OneLineParser, usage_error
from trainer.data.image_io import SUPPORTED_ENDINGS, ImageReadError, file_ending, read_labels
from trainer.data.labels import Key, LabelError, LabelSpec, from_dataset_json, key_mask, metric_key
from trainer.schema.atomic import atomic_write_text
from trainer.schema.exits import EXIT_OK
from trainer.schema.tree import SUMMARY_FILE

METRICS = ("Dice", "FN", "FP", "IoU", "TN", "TP", "n_pred", "n_ref")


class EvaluationError(ValueError):
    """A user mistake (one line; the CLI exits 2)."""


def label_metrics(
    reference: np.ndarray, prediction: np.ndarray, label: Key, keep: np.ndarray | None = None
) -> dict[str, Any]:
    """Metrics of a label value or a region (a tuple of values: voxels in any of them);
    `keep`: the voxels scored (False where the reference holds the ignore label)."""
    ref, pred = key_mask(reference, label), key_mask(prediction, label)
    if keep is not None:
        ref, pred = ref & keep, pred & keep
    tp = int(np.count_nonzero(ref & pred))
    fp = int(np.count_nonzero(pred)) - tp
    fn = int(np.count_nonzero(ref)) - tp
    tn = int(ref.size if keep is None else np.count_nonzero(keep)) - tp - fp - fn
    defined = tp + fp + fn > 0
    return {
        "Dice": 2 * tp / (2 * tp + fp + fn) if defined else None,
        "IoU": tp / (tp + fp + fn) if defined else None,
        "TP": tp,
        "FP": fp,
        "FN": fn,
        "TN": tn,
        "n_pred": tp + fp,
        "n_ref": tp + fn,
    }


def case_metrics(
    reference: np.ndarray,
    prediction: np.ndarray,
    labels: Sequence[Key],
    ignore_label: int | None = None,
) -> dict:
    """Keyed as nnU-Net's summary.json: "1" for a label, "(1, 2, 3)" for a region."""
    if reference.shape != prediction.shape:
        raise EvaluationError(
            f"shapes differ: reference {list(reference.shape)}, prediction {list(prediction.shape)}"
        )
    keep = None if ignore_label is None else reference != ignore_label
    return {metric_key(k): label_metrics(reference, prediction, k, keep) for k in labels}


def _mean(values: list[Any]) -> float | None:
    defined = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return float(np.mean(defined)) if defined else None


def summarize(per_case: list[dict[str, Any]], labels: Sequence[Key]) -> dict[str, Any]:
    """nnU-Net's summary.json content from per-case entries (`metrics` keyed by label)."""
    keys = list(dict.fromkeys(metric_key(label) for label in labels))  # a region twice: once
    means = {
        key: {m: _mean([c["metrics"][key][m] for c in per_case]) for m in METRICS} for key in keys
    }
    foreground = [key for key in keys if key != "0"]
    foreground_mean = {}
    for metric in METRICS:
        values = [means[k][metric] for k in foreground]
        undefined = not values or any(v is None for v in values)
        foreground_mean[metric] = None if undefined else float(np.mean(cast(list[float], values)))
    return {"metric_per_case": per_case, "mean": means, "foreground_mean": foreground_mean}


def _segmentations(folder: Path) -> dict[str, Path]:
    """case id -> file for every image file directly in `folder` (probabilities excluded)."""
    found = {}
    for path in sorted(folder.iterdir()):
        ending = file_ending(path)
        if path.is_file() and ending.lower() in SUPPORTED_ENDINGS and not path.name.startswith("."):
            if ending.lower() == ".npz" and _is_probabilities(path):
                continue
            found[path.name[: -len(ending)]] = path
    return found


def _is_probabilities(path: Path) -> bool:
    with np.load(path, allow_pickle=False) as archive:
        return "probabilities" in archive.files


def _read_labels(path: Path) -> np.ndarray:
    try:
        return read_labels(path)  # any format nnui reads; a 3D TIFF needs no spacing here
    except ImageReadError as exc:
        raise EvaluationError(str(exc)) from None


def dataset_spec(path: Path) -> LabelSpec | None:
    """The labels of a dataset.json (None when absent or unreadable); EvaluationError when
    its labels cannot be scored (trainer.data.labels' one-line reasons)."""
    try:
        dataset_json = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    try:
        return from_dataset_json(dataset_json if isinstance(dataset_json, dict) else {})
    except LabelError as exc:
        raise EvaluationError(f"{path}: {exc}") from None


def default_labels(ref_dir: Path, references: list[np.ndarray] | None = None) -> list[Key]:
    """dataset.json's foreground labels (or regions) next to REF (labelsTr/labelsTs of a raw
    dataset), else the values found in the references."""
    spec = dataset_spec(ref_dir.parent / "dataset.json")
    if spec is not None:
        return spec.foreground_keys
    values: set[int] = set()
    for array in references or []:
        values |= {int(v) for v in np.unique(array)}
    return sorted(values - {0})


def evaluate_folders(
    ref_dir: Path,
    pred_dir: Path,
    labels: Sequence[Key] | None = None,
    chill: bool = False,
    ignore_label: int | None = None,
) -> dict[str, Any]:
    """Every prediction in pred_dir against its reference (one case in memory at a time);
    voxels where the reference holds `ignore_label` are not scored."""
    ref_dir, pred_dir = Path(ref_dir), Path(pred_dir)
    for folder in (ref_dir, pred_dir):
        if not folder.is_dir():
            raise EvaluationError(f"{folder} is not a folder")
    refs, preds = _segmentations(ref_dir), _segmentations(pred_dir)
    if not preds:
        raise EvaluationError(f"{pred_dir} holds no segmentations")
    orphans = sorted(set(preds) - set(refs))
    if orphans:
        raise EvaluationError(f"prediction {preds[orphans[0]].name} has no reference in {ref_dir}")
    missing = sorted(set(refs) - set(preds))
    if missing and not chill:
        raise EvaluationError(
            f"{len(missing)} reference(s) without prediction (first: {missing[0]}); "
            "pass --chill to evaluate only the predicted cases"
        )
    if labels is None:
        labels = default_labels(ref_dir, [_read_labels(refs[c]) for c in sorted(preds)])
    per_case = []
    for case_id in sorted(preds):
        reference, prediction = _read_labels(refs[case_id]), _read_labels(preds[case_id])
        try:
            metrics = case_metrics(reference, prediction, labels, ignore_label)
        except EvaluationError as exc:
            raise EvaluationError(f"case {case_id}: {exc}") from None
        per_case.append(
            {
                "reference_file": str(refs[case_id]),
                "prediction_file": str(preds[case_id]),
                "metrics": metrics,
            }
        )
    return summarize(per_case, list(labels))


def _labels_to_score(args: Any) -> tuple[list[Key] | None, int | None]:
    """-l / -il, else the dataset.json given (-djfile) or next to REF."""
    path = Path(args.djfile) if args.djfile else Path(args.ref).parent / "dataset.json"
    if args.djfile and not path.is_file():
        raise EvaluationError(f"{path} does not exist")
    spec = dataset_spec(path)
    labels = args.l if args.l is not None else (spec.foreground_keys if spec else None)
    ignore = args.il if args.il is not None else (spec.ignore_label if spec else None)
    return labels, ignore


def _rounded(dice: float | None) -> str:
    return "undefined" if dice is None else f"{dice:.4f}"


def write_summary(summary: dict[str, Any], path: Path) -> None:
    # sort_keys as nnU-Net: foreground_mean comes first.
    atomic_write_text(path, json.dumps(summary, sort_keys=True, indent=4, allow_nan=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="nnui-evaluate", description="Dice, IoU, TP/FP/FN/TN per case and label."
    )
    parser.add_argument("ref", help="folder of reference segmentations (e.g. labelsTs)")
    parser.add_argument("pred", help="folder of predicted segmentations")
    parser.add_argument(
        "-l",
        type=int,
        nargs="+",
        default=None,
        help="labels (default: dataset.json next to REF, else those found)",
    )
    parser.add_argument(
        "-il", type=int, default=None, help="ignore label (default: dataset.json's)"
    )
    parser.add_argument(
        "-djfile",
        default=None,
        help="dataset.json whose labels, regions and ignore label are scored "
        "(default: the one next to REF)",
    )
    parser.add_argument("-o", default=None, help=f"output file (default PRED/{SUMMARY_FILE})")
    parser.add_argument("--chill", action="store_true", help="allow references without prediction")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    output = Path(args.o) if args.o else Path(args.pred) / SUMMARY_FILE
    try:
        labels, ignore = _labels_to_score(args)
        summary = evaluate_folders(Path(args.ref), Path(args.pred), labels, args.chill, ignore)
        write_summary(summary, output)
    except (EvaluationError, OSError) as exc:
        return usage_error(exc)
    fg = summary["foreground_mean"]
    cases = len(summary["metric_per_case"])
    print(f"{cases} case(s): foreground mean Dice {_rounded(fg['Dice'])} -> {output}")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
