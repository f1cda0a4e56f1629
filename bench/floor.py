"""The compute floor of nnui: forward + backward + step on one fixed in-memory batch.

    python bench/floor.py DATASET CONFIGURATION [--preprocessed DIR] [--iterations 5]
                          [--threads N] [--channels-last] [--precision auto|fp32|bf16]
                          [--data-batches 40]
                          [--norm instance|group] [--compile [MODE]] [--flush-denormal]
                          [--recompute-norm auto|on|off]
                          [--profile] [--json FILE]

Same network (trainer.network.unet from the plans), loss, optimiser and step code
(trainer.training.loop.train_iterations) as nnui-train, but no data loading: the trainer's
s/iteration divided by this is its overhead over pure compute. It also measures the data
side alone: CPU seconds per sample of patch reading and of augmentation, in the loader
threads as nnui-train runs them on CPU (`time.process_time()` of this process counts them).

Execution variants of the same math (issue 7): --norm group swaps InstanceNorm for
GroupNorm(C, C) (the same normalisation, another kernel), --compile wraps the network in
torch.compile (the compile time is the warm-up iteration, reported apart), and
--flush-denormal sets torch.set_flush_denormal(True). Allocator and oneDNN choices are
environment variables, e.g. LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.allocator import MALLOC_CHOICES  # noqa: E402 - stdlib only, after the path
from trainer.training.config import recomputes_norm  # noqa: E402


@dataclass
class FloorFigures:
    s_per_iteration: float  # median of timed iterations (after one warm-up)
    iterations_s: list[float]
    cpu_s_per_iteration: float  # process CPU (all threads): robust on a loaded machine
    threads: int
    channels_last: bool
    precision: str  # what ran: "float32" or "bf16 autocast" (trainer.network.precision)
    norm: str
    recompute_norm: bool
    compile_mode: str | None
    flush_denormal: bool
    malloc: str
    peak_rss_bytes: int  # VmHWM of this process at the end (loaders, data cost included)
    warmup_s: float  # the first step: includes torch.compile's compile time
    patch_size: list[int]
    batch_size: int
    num_parameters: int
    load_cpu_s_per_sample: float  # reading + cropping patches (nnui's loader threads)
    augment_cpu_s_per_sample: float  # augment_batch in the loader threads (CPU device)
    data_cpu_s_per_sample: float  # the sum: what one augmented training sample costs


def _fixed_batch_and_data_cost(cases, cplan, rank_batch, num_batches: int):
    """One real batch for the floor, and CPU-s/sample of loading and of augmenting.

    Measured as the trainer runs its CPU loader: 2 loader threads reading and augmenting
    (one intra-op thread each) while this thread only takes batches, so the process CPU
    time over N batches is the data side's (a few batches in flight at both ends cancel).
    """
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
            num_workers=2,
        )

    costs = {}
    for augment in (False, True):
        with loader(augment) as stream:
            for _ in range(3):  # warm-up: opens files, allocates, fills the prefetch queue
                batch = next(stream)
            started = time.process_time()
            for _ in range(num_batches):
                batch = next(stream)
            costs[augment] = (time.process_time() - started) / (num_batches * rank_batch.batch_size)
    return batch, costs[False], costs[True] - costs[False]


def _one_rank_batch(global_batch: int):
    """The trainer's batch split for one process."""
    from trainer.training.batch import split_global_batch

    return split_global_batch(global_batch, 1)[0]


def measure(args: argparse.Namespace) -> FloorFigures:
    import torch

    from trainer.data.dataset import PreprocessedCases
    from trainer.network.loss import DeepSupervisionLoss
    from trainer.planning.plans import load_plans
    from trainer.schema.tree import find_dataset, resolve_roots
    from trainer.training.loop import Trainee, train_iterations

    roots = resolve_roots(preprocessed=args.preprocessed)
    dataset_dir = roots.preprocessed / find_dataset(roots.preprocessed, args.dataset)
    plans = load_plans(dataset_dir)
    cplan = plans.configuration(args.configuration)
    if args.threads:
        torch.set_num_threads(args.threads)
    from trainer import allocator
    from trainer.allocator import keep_freed_memory
    from trainer.network import precision

    if args.flush_denormal:
        torch.set_flush_denormal(True)
    rank_batch = _one_rank_batch(cplan.batch_size)
    cases = PreprocessedCases(dataset_dir / cplan.data_identifier)
    batch, load_cost, augment_cost = _fixed_batch_and_data_cost(
        cases, cplan, rank_batch, args.data_batches
    )
    torch.manual_seed(0)
    recompute = recomputes_norm(args.recompute_norm, "cpu", cplan.ndim)
    model = _build(args.norm, cplan, plans, recompute)
    if args.channels_last:
        fmt = torch.channels_last_3d if cplan.ndim == 3 else torch.channels_last
        model = model.to(memory_format=fmt)
        batch.data = batch.data.contiguous(memory_format=fmt)
    # The same optimiser settings as trainer.training.worker (nnU-Net defaults).
    optimizer = torch.optim.SGD(
        model.parameters(), lr=1e-2, momentum=0.99, weight_decay=3e-5, nesterov=True
    )
    stepped = model if args.compile is None else _compiled(model, args.compile)
    autocast_dtype = precision.autocast_dtype(args.precision, "cpu")
    trainee = Trainee(
        model=stepped,
        raw_model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        loss_fn=DeepSupervisionLoss(
            len(cplan.network.features_per_stage) - 1, batch_dice=cplan.batch_dice
        ),
        device=torch.device("cpu"),
        autocast_dtype=autocast_dtype,
        num_classes=plans.num_classes,
        # What the trainer does on CPU (after its first step): the floor runs the same way.
        after_first_step=None if args.default_malloc else keep_freed_memory,
    )

    def same_batch():
        while True:
            yield batch

    batches = same_batch()
    warmup_started = time.perf_counter()
    train_iterations(trainee, batches, 1, 12.0)  # warm-up (allocator, kernels, compile)
    warmup_s = time.perf_counter() - warmup_started
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
        precision=precision.describe(autocast_dtype),
        norm=args.norm,
        recompute_norm=recompute,
        compile_mode=args.compile,
        flush_denormal=args.flush_denormal,
        malloc="glibc defaults" if args.default_malloc else allocator.describe(),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB
        warmup_s=warmup_s,
        patch_size=list(cplan.patch_size),
        batch_size=cplan.batch_size,
        num_parameters=sum(p.numel() for p in model.parameters()),
        load_cpu_s_per_sample=load_cost,
        augment_cpu_s_per_sample=augment_cost,
        data_cpu_s_per_sample=load_cost + augment_cost,
    )


def _build(norm: str, cplan, plans, recompute: bool):
    """The trainer's network; norm="group" swaps in GroupNorm(C, C) during construction."""
    from torch import nn

    from trainer.network import build as model_module
    from trainer.network import unet

    if norm == "instance":
        return model_module.build_network(
            cplan.network, plans.num_input_channels, plans.num_classes, cplan.ndim,
            recompute_norm=recompute,
        )  # fmt: skip

    def group_norm(channels: int, eps: float = 1e-5, affine: bool = True) -> nn.GroupNorm:
        # One group per channel: the same statistics as instance norm, another kernel.
        return nn.GroupNorm(channels, channels, eps=eps, affine=affine)

    saved = dict(unet.NORM)
    unet.NORM.update({2: group_norm, 3: group_norm})
    try:
        return model_module.build_network(
            cplan.network, plans.num_input_channels, plans.num_classes, cplan.ndim,
            recompute_norm=recompute,
        )  # fmt: skip
    finally:
        unet.NORM.update(saved)


def _compiled(model, mode: str):
    import torch

    return torch.compile(model) if mode == "default" else torch.compile(model, mode=mode)


def _profile(trainee, batches) -> None:
    """Where one step's time goes, by operator (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    from trainer.training.loop import train_iterations

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
    p.add_argument(
        "--default-malloc",
        action="store_true",
        help="glibc's malloc as it is: no preload, no keeping of freed blocks",
    )
    p.add_argument(
        "--malloc",
        choices=MALLOC_CHOICES,
        default="auto",
        help="as nnui-train --malloc: auto preloads tcmalloc/jemalloc when installed",
    )
    p.add_argument("--channels-last", action="store_true", help="channels_last(_3d) layout")
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="as nnui-train --precision on CPU (auto: bf16 autocast with AMX, else float32)",
    )
    p.add_argument(
        "--norm", choices=("instance", "group"), default="instance", help="normalisation kernel"
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        metavar="MODE",
        help="torch.compile the network (MODE e.g. max-autotune-no-cudagraphs)",
    )
    p.add_argument(
        "--recompute-norm",
        choices=("auto", "on", "off"),
        default="auto",
        help="recompute norm+activation in backward (auto: as nnui-train on CPU, 3D only)",
    )
    p.add_argument("--flush-denormal", action="store_true", help="torch.set_flush_denormal")
    p.add_argument(
        "--omp-default-spin",
        action="store_true",
        help="libgomp's default spinning (nnui-train limits it on CPU: trainer/training/openmp.py)",
    )
    p.add_argument("--data-batches", type=int, default=40, help="batches timed for data cost")
    p.add_argument("--profile", action="store_true", help="print a torch profiler table")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    if argv is None and not args.default_malloc:  # the trainer's allocator, as nnui-train
        from trainer import allocator

        allocator.reexec_with_caching_allocator("cpu", args.malloc)
    if argv is None and not args.omp_default_spin:  # and its OpenMP wait, as nnui-train
        from trainer.training import openmp

        openmp.limit_spinning("cpu")
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
        f"{figures.num_parameters / 1e6:.1f} M parameters, norm {figures.norm}, "
        f"compile {figures.compile_mode}, warm-up {figures.warmup_s:.1f} s, "
        f"malloc {figures.malloc}, peak RSS {figures.peak_rss_bytes / 2**30:.2f} GiB)"
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
