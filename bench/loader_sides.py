"""One side of `bench/loader.py --real`, run in a fresh process per block (bench/loader.py
starts it): nnU-Net 2.8.1's training batches or nnui's, timed after a warm-up.

    python bench/loader_sides.py SIDE PREPROCESSED_DATASET_FOLDER CONFIGURATION OUT_JSON
        [--workers N] [--warmup 3] [--batches 20] [--seed S] [--profile]

nnU-Net: its own trainer's pieces, as its get_dataloaders() builds the training half
(configure_rotation_dummyDA_mirroring_and_inital_patch_size, get_training_transforms with
deep supervision, nnUNetDataLoader on fold 0's training cases, SingleThreadedAugmenter for
0 workers else NonDetMultiThreadedAugmenter with N processes); no network is built. nnui:
PatchLoader(augment=True) as trainer/training/worker.py builds it (same fold-0 training cases,
oversampling 0.33, use_mask_for_norm), N loader threads (its default worker mode). Both
with one torch thread in this process. CPU seconds count this process and its children.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def tree_cpu_s() -> float:
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(child.cpu_times()[:2])
    return total


def fold0_train_ids(dataset_folder: Path) -> list[str]:
    return sorted(json.loads((dataset_folder / "splits_final.json").read_text())[0]["train"])


def nnunet_stream(folder: Path, configuration: str, workers: int):
    """nnU-Net's training batch generator (its trainer's recipe, minus the network)."""
    os.environ["nnUNet_n_proc_DA"] = str(workers)  # noqa: SIM112 - nnU-Net's own name
    import torch
    from batchgenerators.dataloading.nondet_multi_threaded_augmenter import (
        NonDetMultiThreadedAugmenter,
    )
    from batchgenerators.dataloading.single_threaded_augmenter import SingleThreadedAugmenter
    from nnunetv2.training.dataloading.data_loader import nnUNetDataLoader
    from nnunetv2.training.dataloading.nnunet_dataset import infer_dataset_class
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    plans = json.loads((folder / "nnUNetPlans.json").read_text())
    plans["continue_training"] = False  # run_training.get_trainer_from_args sets it so
    dataset_json = json.loads((folder / "dataset.json").read_text())
    t = nnUNetTrainer(plans, configuration, 0, dataset_json, device=torch.device("cpu"))
    t._set_batch_size_and_oversample()
    t.dataset_class = infer_dataset_class(t.preprocessed_dataset_folder)
    rotation, dummy_2d, initial_patch, mirror_axes = (
        t.configure_rotation_dummyDA_mirroring_and_inital_patch_size()
    )
    cm, lm = t.configuration_manager, t.label_manager
    transforms = t.get_training_transforms(
        cm.patch_size, rotation, t._get_deep_supervision_scales(), mirror_axes, dummy_2d,
        use_mask_for_norm=cm.use_mask_for_norm, is_cascaded=t.is_cascaded,
        foreground_labels=lm.foreground_labels,
        regions=lm.foreground_regions if lm.has_regions else None, ignore_label=lm.ignore_label,
    )  # fmt: skip
    dataset_tr, _ = t.get_tr_and_val_datasets()
    loader = nnUNetDataLoader(
        dataset_tr, t.batch_size, initial_patch, cm.patch_size, lm,
        oversample_foreground_percent=t.oversample_foreground_percent,
        sampling_probabilities=None, pad_sides=None, transforms=transforms,
        probabilistic_oversampling=t.probabilistic_oversampling,
    )  # fmt: skip
    info = {"batch_size": t.batch_size, "patch_size": list(cm.patch_size),
            "read_size": [int(v) for v in initial_patch],
            "train_cases": len(dataset_tr.identifiers)}  # fmt: skip
    if workers == 0:
        return SingleThreadedAugmenter(loader, None), None, info
    gen = NonDetMultiThreadedAugmenter(
        loader, None, workers, max(6, workers // 2), None, False, 0.002
    )
    return gen, gen._finish, info


def nnui_stream(folder: Path, configuration: str, workers: int, seed: int):
    """nnui's PatchLoader as its trainer builds it for the training stream."""
    import torch

    from trainer.data.dataset import PreprocessedCases
    from trainer.data.loader import PatchLoader
    from trainer.planning.plans import load_plans

    config = load_plans(folder).configuration(configuration)
    cases = PreprocessedCases(folder / config.data_identifier)
    train = fold0_train_ids(folder)
    loader = PatchLoader(
        cases, train, tuple(config.patch_size), config.batch_size, 0.33, seed, 0,
        torch.device("cpu"), augment=True, num_workers=workers, prefetch=max(2, workers),
        mask_channels=tuple(config.use_mask_for_norm),
    )  # fmt: skip
    info = {"batch_size": config.batch_size, "patch_size": list(config.patch_size),
            "read_size": list(loader.spec.read_size or ()), "train_cases": len(train)}  # fmt: skip
    return loader, loader.close, info


def top_functions(profile: cProfile.Profile, n: int = 10) -> list[dict]:
    """The n functions with the most own time (tottime) and their share of the total."""
    stats = pstats.Stats(profile)
    total = stats.total_tt or 1.0
    rows = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        where = f"{Path(path).name}:{line}" if line else path
        rows.append({"function": f"{name} ({where})", "calls": calls, "tottime_s": tottime,
                     "share": tottime / total, "cumtime_s": cumtime})  # fmt: skip
    return sorted(rows, key=lambda r: -r["tottime_s"])[:n]


def time_batches(stream, warmup: int, batches: int, profile: bool) -> dict:
    for _ in range(warmup):  # worker start, first file opens, caches
        next(stream)
    # CPU time, not wall: on a shared machine wall time mostly measures the neighbours
    prof = cProfile.Profile(time.process_time) if profile else None
    walls = []
    cpu0, wall0 = tree_cpu_s(), time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(batches):
        started = time.perf_counter()
        batch = next(stream)
        walls.append(time.perf_counter() - started)
    if prof:
        prof.disable()
    cpu, wall = tree_cpu_s() - cpu0, time.perf_counter() - wall0  # children still alive
    del batch
    out = {"batches": batches, "cpu_s": cpu, "wall_s": wall, "batch_wall_s": walls}
    if prof:
        out["profile"] = top_functions(prof, 12)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("side", choices=("nnU-Net", "nnui"))
    p.add_argument("folder", type=Path)
    p.add_argument("configuration")
    p.add_argument("out", type=Path)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    import numpy as np
    import torch

    torch.set_num_threads(1)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    if a.side == "nnU-Net":
        stream, close, info = nnunet_stream(a.folder, a.configuration, a.workers)
    else:
        stream, close, info = nnui_stream(a.folder, a.configuration, a.workers, a.seed)
    try:
        result = time_batches(stream, a.warmup, a.batches, a.profile)
    finally:
        if close is not None:
            close()
    result.update(info, side=a.side, workers=a.workers)
    a.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
