"""The compute floor of nnui: forward + backward + step on one fixed in-memory batch.

    python bench/floor.py DATASET CONFIGURATION [--preprocessed DIR] [--iterations 5]
                          [--threads N] [--channels-last] [--bf16] [--data-batches 40]
                          [--profile] [--json FILE]

Same network (trainer.model from the plans), loss, optimiser and step code
(trainer.loop.train_iterations) as nnui-train, but no data loading: the trainer's
s/iteration divided by this is its overhead over pure compute. It also measures the data
side alone: CPU seconds per sample of patch reading and of augmentation, run inline
(no workers) so `time.process_time()` of this process counts all of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@dataclass
class FloorFigures:
    s_per_iteration: float  # median of timed iterations (after one warm-up)
    iterations_s: list[float]
    cpu_s_per_iteration: float  # process CPU (all threads): robust on a loaded machine
    threads: int
    channels_last: bool
    bf16: bool
    patch_size: list[int]
    batch_size: int
    num_parameters: int
    load_cpu_s_per_sample: float  # reading + cropping patches (nnui's loader workers)
    augment_cpu_s_per_sample: float  # augment_batch on the CPU device
    data_cpu_s_per_sample: float  # the sum: what one augmented training sample costs


def _fixed_batch_and_data_cost(cases, cplan, rank_batch, num_batches: int):
    """One real batch for the floor, and CPU-s/sample of loading and of augmenting."""
    import torch

    from trainer.data.loader import PatchLoader

    def loader(augment: bool) -> PatchLoader:
        return PatchLoader(
            cases,
            cases.case_ids,
            tuple(cplan.patch_size),
            rank_batch.batch_size,
            rank_batch.oversample_share,
            12345,
            0,
            torch.device("cpu"),
            augment=augment,
            num_workers=0,
        )

    costs = {}
    for augment in (False, True):
        with loader(augment) as stream:
            batch = next(stream)  # warm-up: opens files, allocates
            started = time.process_time()
            for _ in range(num_batches):
                batch = next(stream)
            costs[augment] = (time.process_time() - started) / (num_batches * rank_batch.batch_size)
    return batch, costs[False], costs[True] - costs[False]


def _one_rank_batch(global_batch: int):
    """The trainer's batch split for one process (the function moved between modules)."""
    try:
        from trainer.launch import split_global_batch
    except ImportError:
        from trainer.distributed import split_global_batch
    return split_global_batch(global_batch, 1)[0]


def measure(args: argparse.Namespace) -> FloorFigures:
    import torch

    from trainer.data.dataset import PreprocessedCases
    from trainer.loop import Trainee, train_iterations
    from trainer.loss import DeepSupervisionLoss
    from trainer.model import build_network
    from trainer.plans import load_plans
    from trainer.schema import find_dataset, resolve_roots

    roots = resolve_roots(preprocessed=args.preprocessed)
    dataset_dir = roots.preprocessed / find_dataset(roots.preprocessed, args.dataset)
    plans = load_plans(dataset_dir)
    cplan = plans.configuration(args.configuration)
    if args.threads:
        torch.set_num_threads(args.threads)
    rank_batch = _one_rank_batch(cplan.batch_size)
    cases = PreprocessedCases(dataset_dir / cplan.data_identifier)
    batch, load_cost, augment_cost = _fixed_batch_and_data_cost(
        cases, cplan, rank_batch, args.data_batches
    )
    torch.manual_seed(0)
    model = build_network(cplan.network, plans.num_input_channels, plans.num_classes, cplan.ndim)
    if args.channels_last:
        fmt = torch.channels_last_3d if cplan.ndim == 3 else torch.channels_last
        model = model.to(memory_format=fmt)
        batch.data = batch.data.contiguous(memory_format=fmt)
    # The same optimiser settings as trainer.worker (nnU-Net defaults).
    optimizer = torch.optim.SGD(
        model.parameters(), lr=1e-2, momentum=0.99, weight_decay=3e-5, nesterov=True
    )
    trainee = Trainee(
        model=model,
        raw_model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        loss_fn=DeepSupervisionLoss(len(cplan.network.features_per_stage) - 1),
        device=torch.device("cpu"),
        autocast_dtype=None,
        num_classes=plans.num_classes,
    )

    def same_batch():
        while True:
            yield batch

    batches = same_batch()
    train_iterations(trainee, batches, 1, 12.0)  # warm-up (allocator, kernels)
    times, cpu_times = [], []
    for _ in range(args.iterations):
        started, cpu_started = time.perf_counter(), time.process_time()
        train_iterations(trainee, batches, 1, 12.0)
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
    if args.profile:
        _profile(trainee, batches)
    times_sorted = sorted(times)
    return FloorFigures(
        s_per_iteration=times_sorted[len(times) // 2],
        iterations_s=[round(t, 4) for t in times],
        cpu_s_per_iteration=sorted(cpu_times)[len(cpu_times) // 2],
        threads=torch.get_num_threads(),
        channels_last=args.channels_last,
        bf16=args.bf16,
        patch_size=list(cplan.patch_size),
        batch_size=cplan.batch_size,
        num_parameters=sum(p.numel() for p in model.parameters()),
        load_cpu_s_per_sample=load_cost,
        augment_cpu_s_per_sample=augment_cost,
        data_cpu_s_per_sample=load_cost + augment_cost,
    )


def _profile(trainee, batches) -> None:
    """Where one step's time goes, by operator (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    from trainer.loop import train_iterations

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_iterations(trainee, batches, 2, 12.0)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="floor", description=__doc__.splitlines()[0])
    p.add_argument("dataset", help="dataset id or name, e.g. 900")
    p.add_argument("configuration", help="e.g. 3d_fullres")
    p.add_argument("--preprocessed", default=None, help="preprocessed root")
    p.add_argument("--iterations", type=int, default=5, help="timed iterations")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--channels-last", action="store_true", help="channels_last(_3d) layout")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (CPU) for the step")
    p.add_argument("--data-batches", type=int, default=40, help="batches timed for data cost")
    p.add_argument("--profile", action="store_true", help="print a torch profiler table")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.iterations < 1 or args.data_batches < 1:
        print("error: --iterations and --data-batches must be >= 1", file=sys.stderr)
        return 2
    try:
        figures = measure(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"floor: {figures.s_per_iteration:.3f} s/iteration, "
        f"{figures.cpu_s_per_iteration:.2f} CPU-s/iteration ({figures.threads} threads, "
        f"patch {figures.patch_size}, batch {figures.batch_size}, "
        f"{figures.num_parameters / 1e6:.1f} M parameters)"
    )
    print(
        f"data: load {figures.load_cpu_s_per_sample:.4f} + augment "
        f"{figures.augment_cpu_s_per_sample:.4f} = {figures.data_cpu_s_per_sample:.4f} "
        "CPU-s/sample"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(figures), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
