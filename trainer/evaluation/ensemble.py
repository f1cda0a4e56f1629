"""`nnui-ensemble -i DIR1 DIR2 ... -o OUT [--save_probabilities]`: average the saved
probabilities of several predictions (nnui-predict --save_probabilities) and write the
segmentations, in the geometry of the first folder's segmentation of each case.

All folders must hold the same cases with the same labels; everything is checked before
anything is written. One case is in memory at a time; files are written atomically.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainer.cli import OneLineParser, one_line, usage_error
from trainer.data.image_io import SUPPORTED_ENDINGS, ImageReadError
from trainer.data.labels import REGIONS_CLASS_ORDER, LabelSpec, parse_labels, prediction_labels
from trainer.inference.cases import InputError
from trainer.inference.export import (
    PROBABILITIES_KEY,
    RawPrediction,
    write_prediction,
)
from trainer.inference.postprocess import Step, keep_largest_component, read_postprocessing
from trainer.inference.predict import PREDICTION_INFO_FILE
from trainer.planning.plans import plans_labels
from trainer.schema.atomic import atomic_write_text
from trainer.schema.exits import EXIT_OK
from trainer.schema.nnunet import refuse_nnunet_output


class EnsembleError(ValueError):
    """A user mistake (one line; the CLI exits 2)."""


def _info(folder: Path) -> dict[str, Any]:
    path = folder / PREDICTION_INFO_FILE
    try:
        info = json.loads(path.read_text())
        info["labels"] = plans_labels(info["labels"])
        info["spec"] = parse_labels(info["labels"], info.get(REGIONS_CLASS_ORDER))
    except FileNotFoundError:
        raise EnsembleError(
            f"{folder} has no {PREDICTION_INFO_FILE}: ensemble folders written by "
            "nnui-predict --save_probabilities"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise EnsembleError(f"{path} is unreadable ({one_line(exc)})") from None
    return info


def _segmentation_file(folder: Path, case_id: str) -> tuple[Path, str]:
    """The case's segmentation in the first folder: its format (the input's, as
    nnui-predict wrote it) and geometry are the ensemble's."""
    for ending in SUPPORTED_ENDINGS:
        path = folder / f"{case_id}{ending}"
        if ending != ".npz" and path.is_file():
            return path, ending
    raise EnsembleError(f"{folder} has {case_id}.npz but no segmentation {case_id}.<ending>")


def plan_ensemble(folders: list[Path], out_dir: Path) -> tuple[list[str], LabelSpec]:
    """(case ids, labels) after every check."""
    if len(folders) < 2:
        raise EnsembleError("-i needs at least two folders")
    try:
        refuse_nnunet_output(out_dir)
    except ValueError as error:
        raise EnsembleError(str(error)) from None
    for folder in folders:
        if not folder.is_dir():
            raise EnsembleError(f"{folder} is not a folder")
        if folder.resolve() == out_dir.resolve():
            raise EnsembleError(f"-o {out_dir} is one of the input folders: choose another")
    infos = [_info(folder) for folder in folders]
    for folder, info in zip(folders[1:], infos[1:], strict=True):
        if info["spec"] != infos[0]["spec"]:  # labels, regions and their order alike
            raise EnsembleError(
                f"{folder} has labels {info['labels']}, {folders[0]} {infos[0]['labels']}"
                + _order_note(info, infos[0])
            )
    case_sets = [{p.stem for p in folder.glob("*.npz")} for folder in folders]
    if not case_sets[0]:
        raise EnsembleError(f"{folders[0]} holds no CASE.npz (predict with --save_probabilities)")
    for folder, cases in zip(folders[1:], case_sets[1:], strict=True):
        differ = sorted(cases ^ case_sets[0])
        if differ:
            raise EnsembleError(
                f"{folder} and {folders[0]} hold different cases (first: {differ[0]}.npz)"
            )
    case_ids = sorted(case_sets[0])
    for case_id in case_ids:
        _segmentation_file(folders[0], case_id)
    return case_ids, infos[0]["spec"]


def _order_note(info: dict, first: dict) -> str:
    ours, theirs = info.get(REGIONS_CLASS_ORDER), first.get(REGIONS_CLASS_ORDER)
    return "" if ours == theirs else f" (regions_class_order {ours} vs {theirs})"


def mean_probabilities(files: list[Path]) -> np.ndarray:
    """Mean of the `probabilities` arrays (float64 sum: the order of folders cannot matter)."""
    total: np.ndarray | None = None
    for path in files:
        try:
            with np.load(path, allow_pickle=False) as archive:
                probs = archive[PROBABILITIES_KEY]
        except (OSError, ValueError, KeyError) as exc:
            raise EnsembleError(f"cannot read {PROBABILITIES_KEY} from {path}: {exc}") from None
        if total is not None and probs.shape != total.shape:
            raise EnsembleError(
                f"{path}: probabilities of shape {list(probs.shape)}, "
                f"{files[0]} {list(total.shape)}"
            )
        total = probs.astype(np.float64) if total is None else total + probs
    assert total is not None, "no files"
    return (total / len(files)).astype(np.float32)


def ensemble(
    folders: list[Path],
    out_dir: Path,
    save_probabilities: bool = False,
    progress: Callable[[str], None] = print,
    largest_component_labels: tuple[Step, ...] = (),
) -> int:
    case_ids, spec = plan_ensemble(folders, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {"ensemble_of": [str(f) for f in folders], **prediction_labels(spec)}
    atomic_write_text(out_dir / PREDICTION_INFO_FILE, json.dumps(info, indent=1) + "\n")
    for index, case_id in enumerate(case_ids):
        started = time.perf_counter()
        probs = mean_probabilities([folder / f"{case_id}.npz" for folder in folders])
        # Mean softmax -> argmax; mean sigmoid of regions -> thresholds in regions_class_order.
        seg = spec.to_segmentation(probs)
        if largest_component_labels:
            seg = keep_largest_component(seg, largest_component_labels)
        reference, ending = _segmentation_file(folders[0], case_id)
        prediction = RawPrediction(seg, probs if save_probabilities else None)
        try:
            write_prediction(out_dir, case_id, prediction, reference, ending)
        except ImageReadError as exc:  # e.g. a reference in a format that cannot hold these labels
            raise EnsembleError(str(exc)) from None
        progress(
            f"[ensemble {index + 1}/{len(case_ids)}] {case_id} shape {list(seg.shape)} "
            f"{time.perf_counter() - started:.1f} s"
        )
    return len(case_ids)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="nnui-ensemble", description="Average saved probabilities.")
    parser.add_argument("-i", nargs="+", required=True, help="prediction folders (>= 2)")
    parser.add_argument("-o", required=True, help="output folder")
    parser.add_argument("--save_probabilities", action="store_true", help="also write CASE.npz")
    parser.add_argument(
        "--postprocess",
        default=None,
        metavar="FILE",
        help="postprocessing.json of nnui-find-best-configuration",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        largest = tuple(read_postprocessing(Path(args.postprocess))) if args.postprocess else ()
        folders = [Path(f) for f in args.i]
        num = ensemble(folders, Path(args.o), args.save_probabilities, print, largest)
    except (EnsembleError, InputError, OSError) as exc:
        return usage_error(exc)
    print(f"ensembled {num} case(s) of {len(args.i)} folders -> {args.o}")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
