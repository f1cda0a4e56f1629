"""Streams the cases of a prediction: case i+1 is read and preprocessed in a thread while
case i is predicted, and case i-1 is exported and written in another. At most three cases
are in memory whatever the folder size; every output file is written atomically.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from trainer.data.labels import LabelSpec
from trainer.inference.cases import InputCase
from trainer.inference.export import RawPrediction, write_prediction
from trainer.inference.postprocess import Step
from trainer.inference.prepare import PreparedCase, prepare_case
from trainer.inference.region_export import export_raw
from trainer.inference.sliding import memory_format, predict_probabilities
from trainer.network import precision
from trainer.planning.plans import ConfigurationPlan, Plans

log = logging.getLogger(__name__)
# predict_cases' hooks (a supervised prediction, trainer.inference.events): should_stop(i)
# is asked before case i (a graceful stop: the cases begun are written, the rest left);
# on_case hears (case id, 1-based index, number of cases, seconds, input shape) once written.
CaseHook = Callable[[str, int, int, float, Sequence[int]], None]


@dataclass(frozen=True)
class PredictSettings:
    out_dir: Path
    step_size: float = 0.5
    mirror: bool = True
    save_probabilities: bool = False
    fallback_spacing: tuple[float, ...] | None = None
    largest_component_labels: tuple[Step, ...] = ()  # --postprocess
    precision: str = "auto"  # trainer.network.precision: autocast on CUDA and AMX CPUs
    previous_stage_dir: Path | None = None  # a cascade: the previous stage's segmentations
    mirror_axes: tuple[int, ...] | None = None  # --mirror_axes (None: every patch axis)


def build_models(
    plans: Plans, cplan: ConfigurationPlan, weights: Sequence[dict], device: torch.device
) -> list[torch.nn.Module]:
    """One evaluation-mode network per fold from `model.*` tensors (checkpoint.load)."""
    from trainer.data.cascade import input_channels
    from trainer.network.build import build_network

    models = []
    for tensors in weights:
        model = build_network(
            cplan.network,
            input_channels(plans, cplan),  # the cascade adds the previous stage's one-hot
            plans.num_classes,
            cplan.ndim,
            deep_supervision=False,
            recompute_norm=False,
        )
        state = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
        model.load_state_dict(state)
        layout = memory_format(device, cplan.ndim)
        # Module.to takes memory_format (torch's docs); its type stubs leave it out.
        models.append(model.to(device, memory_format=layout).eval())  # type: ignore[call-overload]
    return models


def output_path(out_dir: Path, case: InputCase) -> Path:
    return Path(out_dir) / f"{case.case_id}{case.ending}"


def predict_cases(
    cases: Sequence[InputCase],
    plans: Plans,
    cplan: ConfigurationPlan,
    models: Sequence[torch.nn.Module],
    device: torch.device,
    settings: PredictSettings,
    progress: Callable[[str], None] = log.info,
    should_stop: Callable[[int], bool] | None = None,
    on_case: CaseHook | None = None,
) -> int:
    """Predict and write every case in order; returns the number written. The first error
    (of reading, predicting or writing) is raised once the threads are idle."""
    total = len(cases)
    spec = plans.label_spec  # regions: sigmoid outputs, label map in regions_class_order
    autocast_dtype = precision.autocast_dtype(settings.precision, device.type)
    progress(f"precision: {precision.describe(autocast_dtype)}")
    with (
        ThreadPoolExecutor(1, "nnui-read") as reader,
        ThreadPoolExecutor(1, "nnui-write") as writer,
    ):

        def read(i: int) -> Future:
            return reader.submit(
                prepare_case, cases[i], plans, cplan, settings.fallback_spacing,
                settings.previous_stage_dir,
            )  # fmt: skip

        next_case = read(0) if cases else None
        pending_write: Future | None = None
        num_done = 0
        try:
            for i in range(total):
                if should_stop is not None and should_stop(i):
                    break
                started = time.perf_counter()
                prepared: PreparedCase = cast(Future, next_case).result()  # read ahead for i
                next_case = read(i + 1) if i + 1 < total else None
                probs = predict_probabilities(
                    models, prepared.data, cplan.patch_size, plans.num_classes, device,
                    settings.step_size, settings.mirror, autocast_dtype, spec.has_regions,
                    settings.mirror_axes).cpu()  # fmt: skip
                if pending_write is not None:
                    pending_write.result()  # at most one case waits to be written
                pending_write = writer.submit(
                    _export, prepared, probs, spec, settings, started, i, total, progress,
                    on_case,
                )  # fmt: skip
                num_done = i + 1
                del prepared, probs
            if pending_write is not None:
                pending_write.result()
        except BaseException:
            for future in (next_case, pending_write):
                if future is not None:
                    future.cancel()
            raise
        if next_case is not None:
            next_case.cancel()  # stopped: the case read ahead is not predicted
    return num_done


def _export(
    prepared: PreparedCase,
    probs: torch.Tensor,
    spec: LabelSpec,
    settings: PredictSettings,
    started: float,
    index: int,
    total: int,
    progress: Callable[[str], None],
    on_case: CaseHook | None = None,
) -> None:
    prediction = export_raw(
        probs, prepared.properties, spec, keep_probabilities=settings.save_probabilities
    )
    if settings.largest_component_labels:
        from trainer.inference.postprocess import keep_largest_component

        segmentation = keep_largest_component(
            prediction.segmentation, settings.largest_component_labels
        )
        prediction = RawPrediction(segmentation, prediction.probabilities)
    case = prepared.case
    write_prediction(settings.out_dir, case.case_id, prediction, case.image_files[0], case.ending)
    props = prepared.properties
    seconds = time.perf_counter() - started
    progress(
        f"[predict {index + 1}/{total}] {case.case_id} shape {props['shape_before_cropping']} "
        f"-> {props['shape_after_resampling']} {seconds:.1f} s"
    )
    if on_case is not None:
        on_case(case.case_id, index + 1, total, seconds, props["shape_before_cropping"])
