"""Final validation in the raw geometry (docs/training.md): what nnui-predict would write for
each validation case, scored against the raw dataset's labelsTr.

Each rank predicts its share of the validation cases (val_ids[rank::W]) from the
preprocessed data with the inference engine's sliding window (Gaussian weights, mirroring
TTA unless --val_disable_tta), brings the probabilities back to the raw geometry
(trainer.inference.export) and hands the segmentation (uint8/int32 tensor; the
probabilities too with --npz) to rank 0, the only writer under results. Rank 0 writes
`validation/CASE<raw ending>` with channel 0's header and affine (as nnui-predict), scores
it against `labelsTr/CASE<ending>` and writes `validation/summary.json` in nnU-Net's layout
(trainer.evaluation.evaluate), so `nnui-evaluate labelsTr validation --chill` gives the same.

Without the raw dataset (a training run only; the CLI said so at start) the cases are
scored in the preprocessed space against CASE_seg.b2nd and no segmentation is written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: they pull in torch
    import torch

    from trainer.data.labels import LabelSpec
    from trainer.planning.plans import ConfigurationPlan, Plans
    from trainer.training.config import TrainConfig
    from trainer.training.launch import Topology

log = logging.getLogger("trainer")


class RawDataMissing(ValueError):
    """No raw dataset folder where the roots point (one line)."""


# ---- start-up checks (CLI process, rank 0; no voxel is read) ------------------------------


def _raw_ending(raw_dataset: Path) -> str:
    path = raw_dataset / "dataset.json"
    try:
        return str(json.loads(path.read_text())["file_ending"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: no readable 'file_ending' ({error})") from None


def validation_case_ids(data_dir: Path, fold: str) -> list[str]:
    from trainer.data.dataset import PreprocessedCases
    from trainer.planning.splits import fold_cases, load_or_create_splits

    cases = PreprocessedCases(data_dir)
    splits = load_or_create_splits(data_dir.parent, cases.case_ids, write=False)
    return fold_cases(splits, fold, cases.case_ids)[1]


def check_raw_cases(raw_dataset: Path, data_dir: Path, fold: str, npz: bool) -> None:
    """The raw label and channel-0 image of every validation case, of the shape the case
    was preprocessed from. RawDataMissing: no raw dataset folder; ValueError: a folder that
    does not fit the preprocessed data."""
    from trainer.data.image_io import ImageReadError, image_shape
    from trainer.inference.export import raw_shape

    if not (raw_dataset / "dataset.json").is_file():
        raise RawDataMissing(
            f"no raw dataset at {raw_dataset} for the final validation against its labelsTr "
            "(pass --raw or set nnUNet_raw)"
        )
    ending = _raw_ending(raw_dataset)
    if npz and ending == ".npz":
        raise ValueError(
            "--npz with .npz raw images: the segmentation and the probabilities would both be "
            "CASE.npz in validation/; drop --npz"
        )
    for case_id in validation_case_ids(data_dir, fold):
        label = raw_dataset / "labelsTr" / f"{case_id}{ending}"
        image = raw_dataset / "imagesTr" / f"{case_id}_0000{ending}"
        properties = json.loads((data_dir / f"{case_id}.json").read_text())
        expected = raw_shape(properties)
        for path in (label, image):
            try:
                shape = [int(n) for n in image_shape(path)]
            except (ImageReadError, OSError) as error:
                raise ValueError(f"final validation needs {path}: {error}") from None
            if shape != expected:
                raise ValueError(
                    f"{path} has shape {shape} but case {case_id} was preprocessed from "
                    f"{expected}: the raw data changed; re-run nnui-preprocess"
                )


# ---- the validation (every rank) ----------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where the validation reads and writes; raw_dataset None = the preprocessed space."""

    output_dir: Path
    raw_dataset: Path | None
    ending: str | None  # of the raw files
    label_values: list[int]  # sorted, background first: what a prediction can hold
    foreground: list[Any]  # scored keys: label values, or regions (tuples)
    preprocessed_dir: Path
    spec: LabelSpec

    def reference(self, case_id: str) -> Path:
        assert self.raw_dataset is not None
        return self.raw_dataset / "labelsTr" / f"{case_id}{self.ending}"

    def image(self, case_id: str) -> Path:
        assert self.raw_dataset is not None
        return self.raw_dataset / "imagesTr" / f"{case_id}_0000{self.ending}"


def make_target(config: TrainConfig, plans: Plans, preprocessed_dir: Path, is_main: bool) -> Target:
    """Only rank 0 reads the raw dataset (other nodes may not have it)."""
    from trainer.data.labels import is_plain
    from trainer.evaluation.evaluate import default_labels
    from trainer.schema.tree import VALIDATION_DIR
    from trainer.training import distributed

    spec = plans.label_spec
    values = list(spec.output_values)
    # Under torchrun only rank 0's CLI looked for the raw data: its answer holds for all.
    raw_dir = distributed.broadcast_object(config.raw_dataset_dir)
    raw = Path(raw_dir) if raw_dir else None
    foreground = spec.foreground_keys
    ending = None
    if raw is not None and is_main:
        ending = _raw_ending(raw)
        if is_plain(spec):
            foreground = default_labels(raw / "labelsTr")  # what nnui-evaluate takes
    output = Path(config.run_dir) / VALIDATION_DIR
    return Target(output, raw, ending, values, foreground, Path(preprocessed_dir), spec)


def evaluation_model(
    plans: Plans, cplan: ConfigurationPlan, raw_model: Any, device: torch.device
) -> Any:
    """The network nnui-predict builds from checkpoint_final (deep supervision off, no
    recomputation, eval mode), with the trained weights: so the validation's numbers are
    the very numbers a prediction gives."""
    from trainer.inference.engine import build_models

    weights = {f"model.{k}": v.detach() for k, v in raw_model.state_dict().items()}
    return build_models(plans, cplan, [weights], device)[0]


# (case id, RawPrediction) of this rank's case number `index` -> None
CaseSink = Callable[[int, str, Any], None]


def progress_line(num_done: int, num_cases: int, elapsed_s: float) -> str:
    """The console's line after each round of cases: `final validation: case 3/20,
    12.0 s/case, ETA 3 min 24 s` (cases of every rank, time since the validation began)."""
    per_case_s = elapsed_s / max(num_done, 1)
    left_s = per_case_s * max(num_cases - num_done, 0)
    return (f"final validation: case {num_done}/{num_cases}, {per_case_s:.1f} s/case, "
            f"ETA {duration_words(left_s)}")  # fmt: skip


def duration_words(seconds: float) -> str:
    """45 s, 3 min 24 s, 2 h 05 min: whole words, never cut."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total} s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def predict_share(
    model: Any,
    cases: Any,
    case_ids: list[str],
    cplan: ConfigurationPlan,
    num_classes: int,
    device: torch.device,
    mirror: bool,
    target: Target,
    keep_probabilities: bool,
    sink: CaseSink,
    autocast_dtype: Any = None,
    mirror_axes: tuple[int, ...] | None = None,
) -> list[list]:
    """Predict this rank's cases in order; each goes to `sink` in the raw geometry. Returns
    [case id, summary entry] scored in the preprocessed space (only without raw data)."""
    import numpy as np

    from trainer.evaluation.evaluate import case_metrics
    from trainer.inference.region_export import export_raw
    from trainer.inference.sliding import predict_probabilities

    entries = []
    spec = target.spec
    for index, case_id in enumerate(case_ids):
        image, seg, properties = cases.load_case(case_id)
        probs = predict_probabilities(
            [model], np.asarray(image), cplan.patch_size, num_classes, device,
            mirror=mirror, autocast_dtype=autocast_dtype, sigmoid=spec.has_regions,
            mirror_axes=mirror_axes,
        ).cpu()  # fmt: skip
        if target.raw_dataset is None:
            prediction = spec.to_segmentation(probs.numpy())
            reference = np.maximum(np.asarray(seg)[0], 0)
            entries.append([case_id, {
                "reference_file": str(target.preprocessed_dir / f"{case_id}_seg.b2nd"),
                "prediction_file": None,
                "metrics": case_metrics(reference, prediction, target.foreground,
                                        spec.ignore_label),
            }])  # fmt: skip
        raw = export_raw(probs, properties, spec, keep_probabilities)
        del probs, image, seg
        sink(index, case_id, raw)
    return entries


class Collector:
    """Rank 0: writes every case into validation/ and scores it against its raw label, one
    case in memory at a time. `entries`: (case id, summary entry) of the scored cases."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.entries: list[tuple[str, dict]] = []
        # 3d_lowres: (case id, raw segmentation) -> the next stage's input (trainer.data.cascade)
        self.next_stage: Callable[[str, Any], None] | None = None

    def add(self, case_id: str, prediction: Any) -> None:
        from trainer.data.image_io import read_image
        from trainer.evaluation.evaluate import case_metrics
        from trainer.inference.export import probabilities_bytes, write_prediction
        from trainer.schema.atomic import atomic_write_bytes

        target = self.target
        if target.raw_dataset is None:  # scored where it was predicted; probabilities only
            if prediction.probabilities is not None:
                path = target.output_dir / f"{case_id}.npz"
                atomic_write_bytes(path, probabilities_bytes(prediction.probabilities))
            return
        assert target.ending is not None
        write_prediction(target.output_dir, case_id, prediction, target.image(case_id),
                         target.ending)  # fmt: skip
        if self.next_stage is not None:
            self.next_stage(case_id, prediction.segmentation)
        reference = read_image(target.reference(case_id))[0]
        entry = {
            "reference_file": str(target.reference(case_id)),
            "prediction_file": str(target.output_dir / f"{case_id}{target.ending}"),
            "metrics": case_metrics(
                reference, prediction.segmentation, target.foreground, target.spec.ignore_label
            ),
        }
        self.entries.append((case_id, entry))


def _transfer_dtypes(label_values: list[int]) -> tuple[Any, Any]:
    """(torch, numpy) dtype a segmentation travels in: gloo sends uint8 and int32, so
    uint16 label maps travel as int32."""
    import numpy as np
    import torch

    return (torch.uint8, np.uint8) if max(label_values) < 256 else (torch.int32, np.int32)


def make_sink(topology: Topology, shares: list[list[str]], collector: Collector | None,
              target: Target, npz: bool, on_case: Callable[[], None],
              on_round: Callable[[int], None] | None = None) -> CaseSink:  # fmt: skip
    """Ranks > 0 send each case (segmentation, then probabilities with --npz) to rank 0,
    which writes its own case of the round, then that round's case of every other rank
    (rank 0 holds the most cases, so its rounds cover everyone's)."""
    import torch

    from trainer.inference.export import RawPrediction, label_dtype
    from trainer.training import distributed

    raw_mode = target.raw_dataset is not None
    wire, wire_numpy = _transfer_dtypes(target.label_values)
    stored = label_dtype(target.label_values)

    def sink(index: int, case_id: str, prediction: Any) -> None:
        on_case()
        if not topology.is_main:
            if raw_mode:
                segmentation = prediction.segmentation.astype(wire_numpy, copy=False)
                distributed.send_to_main(torch.from_numpy(segmentation))
            if npz:
                distributed.send_to_main(torch.from_numpy(prediction.probabilities))
            return
        assert collector is not None
        collector.add(case_id, prediction)
        for rank in range(1, len(shares)):
            if index >= len(shares[rank]):
                continue
            segmentation = probabilities = None
            if raw_mode:
                segmentation = distributed.recv_from(rank, wire).numpy().astype(stored)
            if npz:
                probabilities = distributed.recv_from(rank, torch.float32).numpy()
            collector.add(shares[rank][index], RawPrediction(segmentation, probabilities))
        if on_round is not None:  # rank 0 has every rank's case of this round now
            on_round(sum(min(index + 1, len(share)) for share in shares))

    return sink


def _export_next_stage(
    collector: Collector, config: TrainConfig, plans: Plans, cplan: ConfigurationPlan
) -> None:
    from trainer.data.cascade import export_next_stage

    if collector.target.raw_dataset is None:
        log.warning("no raw dataset: %s's segmentations for %s are not written",
                    cplan.name, ", ".join(cplan.next_stage))  # fmt: skip
        return
    collector.next_stage = lambda case_id, seg: export_next_stage(
        config, plans, cplan, case_id, seg
    )


def validate(config: TrainConfig, topology: Topology, model: Any, cases: Any, val_ids: list[str],
             plans: Plans, cplan: ConfigurationPlan, device: torch.device, autocast_dtype: Any,
             on_case: Callable[[], None],
             on_progress: Callable[[int, int], None] | None = None) -> dict | None:  # fmt: skip
    """Every rank: predict its share; rank 0: write the files and validation/summary.json.
    Returns the summary on rank 0, None elsewhere. `autocast_dtype`: the training's (None:
    float32), which is also nnui-predict's default for the same --precision."""
    from trainer.evaluation.evaluate import summarize, write_summary
    from trainer.schema.tree import SUMMARY_FILE
    from trainer.training import distributed

    target = make_target(config, plans, cases.folder, topology.is_main)
    if topology.is_main:
        target.output_dir.mkdir(parents=True, exist_ok=True)
    world = topology.world_size
    shares = [list(val_ids)[rank::world] for rank in range(world)]
    collector = Collector(target) if topology.is_main else None
    if collector is not None and cplan.next_stage:
        _export_next_stage(collector, config, plans, cplan)

    def on_round(num_done: int) -> None:  # progress: cases of every rank done, of all
        if on_progress is not None:
            on_progress(num_done, len(val_ids))

    sink = make_sink(topology, shares, collector, target, config.npz, on_case, on_round)
    mine = predict_share(
        model, cases, shares[topology.global_rank], cplan, plans.num_classes, device,
        config.val_mirror, target, config.npz, sink, autocast_dtype, config.val_mirror_axes,
    )  # fmt: skip
    gathered = distributed.gather_objects(mine, slow=True)  # also: every rank is done
    if gathered is None:
        return None
    assert collector is not None
    pairs = [*collector.entries, *[tuple(p) for part in gathered for p in part]]
    per_case = [entry for _, entry in sorted(pairs, key=lambda pair: pair[0])]
    summary = summarize(per_case, target.foreground)
    write_summary(summary, target.output_dir / SUMMARY_FILE)
    return summary
