"""`nnui-predict -i IN -o OUT -d DATASET -c CONFIGURATION [-f 0 1 2 3 4]` (also
`python -m trainer.inference.predict`): segment raw images with trained folds.

Every input is checked before anything is written (one `error: ...` line, exit 2): the
folder and its cases (headers only), the checkpoints (header and plans identity), the
device. Then the cases stream through trainer.inference.engine. The output folder gets
`CASE<ending>` in each input's own format and geometry, `CASE.npz` with
--save_probabilities, and `nnui_prediction.json` (what was predicted how, for
nnui-ensemble).

SIGUSR1 stops it gracefully: the case being predicted is finished and written, then it
exits 0 (`--continue_prediction` does the rest later). With `--events FILE` (what nnui
passes to the predictions it supervises) the progress is also written to FILE as JSON lines
(trainer.inference.events); the console output is the same with or without it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import stop
from trainer.cli import OneLineParser, error_text, one_line, usage_error, use_caching_allocator
from trainer.inference import mirroring
from trainer.inference.events import PredictionEvents
from trainer.network import precision
from trainer.schema.events import Kind
from trainer.schema.exits import EXIT_INTERRUPTED, EXIT_OK
from trainer.schema.tree import CHECKPOINT_KINDS, DEFAULT_PLANS, DEFAULT_TRAINER, FOLDS

if TYPE_CHECKING:
    from trainer.inference.postprocess import Step

log = logging.getLogger("trainer.inference.predict")
PREDICTION_INFO_FILE = "nnui_prediction.json"
DEVICES = ("cuda", "cpu", "mps")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="nnui-predict", description="Segment raw images with trained folds.")
    p.add_argument("-i", dest="input", required=True, help="folder of CASE_0000<ending> images")
    p.add_argument("-o", dest="output", required=True, help="output folder (not the input)")
    p.add_argument("-d", dest="dataset", required=True, help="dataset id or DatasetNNN_Name")
    p.add_argument("-c", dest="configuration", required=True, help="e.g. 3d_fullres or 2d")
    p.add_argument(
        "-f",
        dest="folds",
        nargs="+",
        default=["0", "1", "2", "3", "4"],
        help="folds to average (default 0 1 2 3 4), or all",
    )
    p.add_argument("-tr", dest="trainer", default=DEFAULT_TRAINER)
    p.add_argument("-p", dest="plans", default=DEFAULT_PLANS)
    p.add_argument(
        "-chk",
        dest="checkpoint",
        default="checkpoint_final",
        help="checkpoint_final (default), checkpoint_best or checkpoint_latest",
    )
    p.add_argument("-step_size", type=float, default=0.5, help="window step, fraction of patch")
    p.add_argument("--disable_tta", action="store_true", help="no mirroring (8x faster in 3d)")
    p.add_argument(
        "--mirror_axes",
        type=mirroring.parse_axes,
        default=None,
        metavar="AXES",
        help="mirror only these patch axes, e.g. 1,2 (3d: 4 passes instead of 8); "
        "default: every axis, as nnU-Net",
    )
    p.add_argument("--save_probabilities", action="store_true", help="also write CASE.npz")
    p.add_argument(
        "--postprocess",
        default=None,
        metavar="FILE",
        help="postprocessing.json of nnui-find-best-configuration",
    )
    p.add_argument("--continue_prediction", action="store_true", help="skip finished cases")
    p.add_argument(
        "-prev_stage_predictions",
        default=None,
        metavar="DIR",
        help="a cascade (3d_cascade_fullres): the previous stage's segmentations "
        "(default: predict the previous stage first, into OUTPUT/prev_stage_<config>)",
    )
    p.add_argument("-device", default="cuda", choices=DEVICES)
    p.add_argument("--precision", choices=precision.PRECISIONS, default="auto", help=precision.HELP)
    p.add_argument("-num_parts", type=int, default=1, help="split the cases into N parts")
    p.add_argument("-part_id", type=int, default=0, help="which part this process predicts")
    p.add_argument("--preprocessed", default=None, help="default $nnUNet_preprocessed")
    p.add_argument("--results", default=None, help="default $nnUNet_results")
    p.add_argument(
        "--events",
        default=None,
        metavar="FILE",
        help="also append machine-readable progress (JSON lines) to FILE (nnui sets it)",
    )
    return p


@dataclass(frozen=True)
class Resolved:
    plans: Any
    cplan: Any
    dataset_name: str
    checkpoints: dict[str, Path]  # fold -> file
    cases: list  # InputCase, this part's, not yet done
    num_skipped: int
    out_dir: Path
    fallback_spacing: tuple[float, ...] | None
    largest_component_labels: tuple[Step, ...] = ()  # from --postprocess
    previous_stage_dir: Path | None = None  # a cascade's inputs (given, or predicted first)


def checkpoint_kind(name: str) -> str:
    """`checkpoint_final` (also with .safetensors) -> `final`; pickles are refused."""
    stem = name.removesuffix(".safetensors")
    if stem.endswith(".pth"):
        raise ValueError(
            f"-chk {name}: nnui reads safetensors checkpoints only (a .pth is a "
            "pickle that can run code when loaded); pass checkpoint_final"
        )
    kind = stem.removeprefix("checkpoint_")
    if kind not in CHECKPOINT_KINDS:
        raise ValueError(
            f"-chk {name}: choose checkpoint_final, checkpoint_best or checkpoint_latest"
        )
    return kind


def resolve(args: argparse.Namespace) -> Resolved:
    """Every check that needs no voxel data; ValueError with a one-line message."""
    from trainer.inference.cases import check_headers, list_input_cases, select_part
    from trainer.planning.plans import load_plans
    from trainer.schema.nnunet import refuse_nnunet_output
    from trainer.schema.tree import find_dataset, resolve_roots

    in_dir, out_dir = Path(args.input).absolute(), Path(args.output).absolute()
    if in_dir.resolve() == out_dir.resolve():
        raise ValueError(f"-o {args.output} is the input folder: choose another output folder")
    refuse_nnunet_output(out_dir)
    if not 0 < args.step_size <= 1:
        raise ValueError(f"-step_size must be within (0, 1], got {args.step_size}")
    roots = resolve_roots(preprocessed=args.preprocessed, results=args.results)
    name = find_dataset(roots.preprocessed, args.dataset)
    try:
        plans = load_plans(roots.preprocessed / name, args.plans)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    cplan = plans.configuration(args.configuration)
    checkpoints = _checkpoints(args, roots.results, name, plans)
    cases = list_input_cases(in_dir, plans.num_input_channels)
    cases = select_part(cases, args.num_parts, args.part_id)
    todo = cases
    if args.continue_prediction:
        from trainer.inference.engine import output_path

        todo = [c for c in cases if not _done(out_dir, c, args.save_probabilities, output_path)]
    if args.save_probabilities and any(c.ending == ".npz" for c in todo):
        raise ValueError(
            "--save_probabilities with .npz images: both would be CASE.npz; "
            "convert the images to .nii.gz or .npy"
        )
    check_headers(todo)
    largest: tuple[Step, ...] = ()
    if args.postprocess:  # a bad file is refused before any work
        from trainer.inference.postprocess import read_postprocessing

        largest = tuple(read_postprocessing(Path(args.postprocess)))
    previous = _previous_stage(args, cplan, roots.results, name, plans, todo, out_dir)
    return Resolved(
        plans,
        cplan,
        name,
        checkpoints,
        todo,
        len(cases) - len(todo),
        out_dir,
        _fallback_spacing(roots.preprocessed / name),
        largest,
        previous,
    )


def _previous_stage(args: argparse.Namespace, cplan: Any, results: Path, name: str,
                    plans: Any, cases: list, out_dir: Path) -> Path | None:  # fmt: skip
    """A cascade's previous-stage folder: -prev_stage_predictions (every case's file there),
    else OUTPUT/prev_stage_<config>, predicted first with the previous stage's folds."""
    if not cplan.previous_stage:
        if args.prev_stage_predictions:
            raise ValueError(f"-prev_stage_predictions: {args.configuration} is not a cascade")
        return None
    if args.prev_stage_predictions:
        folder = Path(args.prev_stage_predictions).absolute()
        for case in cases:
            if not (folder / f"{case.case_id}{case.ending}").is_file():
                raise ValueError(
                    f"-prev_stage_predictions {folder} has no {case.case_id}{case.ending}: "
                    f"predict {cplan.previous_stage} first"
                )
        return folder
    previous = argparse.Namespace(**{**vars(args), "configuration": cplan.previous_stage})
    _checkpoints(previous, results, name, plans)  # its folds trained: refused now, else
    return out_dir / f"prev_stage_{cplan.previous_stage}"


def _done(out_dir: Path, case: Any, with_probabilities: bool, output_path: Any) -> bool:
    if not output_path(out_dir, case).is_file():
        return False
    return not with_probabilities or (out_dir / f"{case.case_id}.npz").is_file()


def _fallback_spacing(dataset_dir: Path) -> tuple[float, ...] | None:
    """dataset.json's `spacing` (z, y, x) for .npy/.npz images, as in training."""
    try:
        spacing = json.loads((dataset_dir / "dataset.json").read_text()).get("spacing")
    except (OSError, ValueError, AttributeError):
        return None
    return tuple(float(s) for s in spacing) if spacing else None


def _checkpoints(args: argparse.Namespace, results: Path, name: str, plans: Any) -> dict:
    """fold -> checkpoint path, each complete and trained with these very plans."""
    from trainer.checkpoint import store as checkpoint
    from trainer.checkpoint.format import CheckpointError
    from trainer.schema.tree import checkpoint_file, run_dir

    kind = checkpoint_kind(args.checkpoint)
    folds = list(dict.fromkeys(args.folds))
    for fold in folds:
        if fold not in FOLDS:
            raise ValueError(f"-f {fold}: folds are 0-4 or all")
    expected = {
        "dataset_name": name,
        "configuration": args.configuration,
        "plans_name": args.plans,
        "plans_identity": plans.identity_of(args.configuration),
    }
    found = {}
    for fold in folds:
        run = run_dir(results, name, args.configuration, fold, args.trainer, args.plans)
        path = run / checkpoint_file(kind)
        if not path.is_file():
            raise ValueError(
                f"fold {fold} has no {path.name} in {run}: train it first "
                f"(nnui-train {args.dataset} {args.configuration} {fold}) or "
                "leave it out of -f"
            )
        try:
            metadata = checkpoint.read_metadata(path)
        except CheckpointError as exc:
            raise ValueError(f"fold {fold}: {exc}") from None
        mismatch = checkpoint.identity_mismatch(metadata, expected)
        if mismatch is not None:
            key, stored = mismatch
            raise ValueError(
                f"fold {fold}: {path} was trained with another {key} ({str(stored)[:16]!r}, "
                f"these plans give {expected[key][:16]!r}); predict with the plans it was "
                "trained with, or train it again"
            )
        found[fold] = path
    return found


def _device(name: str) -> Any:
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("CUDA is not available on this machine; pass -device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("MPS is not available on this machine; pass -device cpu")
    return torch.device(name)


def _load_weights(checkpoints: dict[str, Path]) -> list[dict]:
    from trainer.checkpoint import store as checkpoint
    from trainer.checkpoint.format import CheckpointError

    weights = []
    for fold, path in checkpoints.items():
        try:
            tensors, _ = checkpoint.load(path)
        except CheckpointError as exc:
            raise ValueError(f"fold {fold}: {exc}") from None
        weights.append({k: v for k, v in tensors.items() if k.startswith("model.")})
    return weights


def _write_info(resolved: Resolved, args: argparse.Namespace) -> None:
    from trainer.data.labels import prediction_labels
    from trainer.schema.atomic import atomic_write_text

    info = {
        "dataset": resolved.dataset_name,
        "configuration": args.configuration,
        "trainer": args.trainer,
        "plans": args.plans,
        "folds": list(resolved.checkpoints),
        "checkpoint": checkpoint_kind(args.checkpoint),
        "step_size": args.step_size,
        "tta": not args.disable_tta,
        "mirror_axes": list(args.mirror_axes) if args.mirror_axes else None,
        "precision": args.precision,
        **prediction_labels(resolved.plans.label_spec),  # labels (+ regions_class_order)
    }
    atomic_write_text(resolved.out_dir / PREDICTION_INFO_FILE, json.dumps(info, indent=1) + "\n")


def run(args: argparse.Namespace, progress: Callable[..., None] = print,  # print-like
        events: PredictionEvents | None = None) -> int:  # fmt: skip
    from trainer.inference.engine import PredictSettings, build_models, predict_cases

    events = events or PredictionEvents(None)
    precision.check(args.precision, args.device)
    resolved = resolve(args)
    mirroring.check_axes(args.mirror_axes, len(resolved.cplan.patch_size), "--mirror_axes")
    _started(events, resolved, args)
    device = _device(args.device)
    if resolved.num_skipped:
        progress(f"--continue_prediction: {resolved.num_skipped} case(s) already done")
    if not resolved.cases:
        progress("nothing to predict")
        events.event(Kind.FINISHED, num_done=0, num_cases=0)
        return EXIT_OK
    if resolved.cplan.previous_stage and not args.prev_stage_predictions:
        _predict_previous_stage(args, resolved, progress)
    weights = _load_weights(resolved.checkpoints)
    try:
        models = build_models(resolved.plans, resolved.cplan, weights, device)
    except RuntimeError as exc:  # tensors of another network shape
        raise ValueError(f"the checkpoints do not fit the plans' network: {exc}") from None
    del weights
    resolved.out_dir.mkdir(parents=True, exist_ok=True)
    _write_info(resolved, args)
    settings = PredictSettings(
        resolved.out_dir, args.step_size, not args.disable_tta, args.save_probabilities,
        resolved.fallback_spacing, resolved.largest_component_labels, args.precision,
        resolved.previous_stage_dir, args.mirror_axes,
    )  # fmt: skip
    started = time.perf_counter()
    num = predict_cases(
        resolved.cases,
        resolved.plans,
        resolved.cplan,
        models,
        device,
        settings,
        lambda line: progress(line, flush=True),
        events.should_stop,
        events.case,
    )
    total = len(resolved.cases)
    progress(
        f"predicted {num} case(s) with {len(models)} fold(s) in "
        f"{time.perf_counter() - started:.1f} s -> {resolved.out_dir}"
    )
    if num < total:  # SIGUSR1: the cases begun are written, the rest left for later
        progress(f"stopped (SIGUSR1) after {num} of {total} case(s); --continue_prediction "
                 "predicts the rest")  # fmt: skip
        events.event(Kind.STOPPED, reason="SIGUSR1", num_done=num, num_cases=total)
    else:
        events.event(Kind.FINISHED, num_done=num, num_cases=total)
    return EXIT_OK


def _predict_previous_stage(
    args: argparse.Namespace, resolved: Resolved, progress: Callable[..., None]
) -> None:
    """The cascade's first stage, with the same folds and settings, into prev_stage_<c>."""
    assert resolved.previous_stage_dir is not None
    stage = resolved.cplan.previous_stage
    progress(f"{args.configuration} is a cascade: predicting {stage} first")
    first = {**vars(args), "configuration": stage, "output": str(resolved.previous_stage_dir),
             "save_probabilities": False, "postprocess": None, "num_parts": 1, "part_id": 0,
             "continue_prediction": True}  # fmt: skip
    first_args = argparse.Namespace(**first)
    first_args.input = (
        str(resolved.cases[0].image_files[0].parent) if resolved.cases else args.input
    )
    run(first_args, progress)


def _started(events: PredictionEvents, resolved: Resolved, args: argparse.Namespace) -> None:
    events.started(
        len(resolved.cases),
        resolved.num_skipped,
        args.device,
        part_id=args.part_id,
        num_parts=args.num_parts,
        folds=list(resolved.checkpoints),
        dataset=resolved.dataset_name,
        configuration=args.configuration,
        checkpoint=checkpoint_kind(args.checkpoint),
        output=str(resolved.out_dir),
    )


def main(argv: list[str] | None = None) -> int:
    stop.install_at_start()  # SIGUSR1 = stop after the current case, from the first moment
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if argv is None:  # a program, not a call from Python (tests): it may re-execute itself
        use_caching_allocator(args.device)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        events = PredictionEvents(args.events)
    except OSError as exc:
        return usage_error(f"--events {args.events}: {exc.strerror or exc}")
    try:
        return _run_recorded(args, events)
    finally:
        events.close()


def _run_recorded(args: argparse.Namespace, events: PredictionEvents) -> int:
    """run(), with every failure also recorded as a `failed` event."""
    try:
        return run(args, events=events)
    except (ValueError, OSError) as exc:  # input and plans checks; a full or read-only disk
        events.failed(error_text(exc))
        return usage_error(exc)
    except KeyboardInterrupt:
        events.failed("interrupted (SIGINT)")
        return EXIT_INTERRUPTED
    except Exception as exc:
        events.failed(f"{type(exc).__name__}: {one_line(exc)}", traceback.format_exc())
        raise


if __name__ == "__main__":
    raise SystemExit(main())
