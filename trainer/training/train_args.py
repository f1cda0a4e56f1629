"""nnui-train's command line: the flags, grouped (trainer.run resolves and checks them).

Imported by trainer.run after its SIGUSR1 handler is installed; no torch here.
"""

from __future__ import annotations

import argparse

from trainer import allocator, legacy
from trainer.cli import OneLineParser
from trainer.inference import mirroring
from trainer.network import precision
from trainer.schema.tree import DEFAULT_PLANS, DEFAULT_TRAINER
from trainer.training.config import AUGMENT_CHOICES, RECOMPUTE_CHOICES


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="nnui-train",
        description="Train one fold of an nnU-Net-v2-style configuration. "
        "SIGUSR1 stops gracefully after the current epoch; --c continues exactly.",
    )
    p.add_argument("dataset", help="dataset id (4, 004) or name (Dataset004_Hippocampus)")
    p.add_argument("configuration", help="configuration from the plans, e.g. 2d or 3d_fullres")
    p.add_argument("fold", help="0-4, or 'all' to train on every case")
    p.add_argument(
        "-tr",
        dest="trainer",
        default=DEFAULT_TRAINER,
        help=f"trainer name (default {DEFAULT_TRAINER}; {legacy.TRAINER_HELP})",
    )
    plans_help = f"plans identifier (default {DEFAULT_PLANS}; e.g. nnuiResEncUNetMPlans)"
    p.add_argument("-p", dest="plans", default=DEFAULT_PLANS, help=plans_help)
    _add_run_flags(p)
    _add_schedule_flags(p)
    _add_execution_flags(p)
    _add_root_flags(p)
    return p


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """What this run does: continue, validate, start from pretrained weights."""
    p.add_argument(
        "--npz", action="store_true", help="also save softmax probabilities of the final validation"
    )
    p.add_argument(
        "--c",
        dest="continue_training",
        action="store_true",
        help="continue from the newest valid checkpoint",
    )
    p.add_argument(
        "--retrain",
        action="store_true",
        help="train a fold that already finished again, from scratch (its checkpoints and "
        "validation are replaced); without it such a fold is refused",
    )
    p.add_argument(
        "--val",
        dest="validation_only",
        action="store_true",
        help="only run the final validation (final checkpoint)",
    )
    p.add_argument("--val_best", action="store_true", help="with --val: use checkpoint_best")
    p.add_argument(
        "--val_disable_tta",
        dest="val_mirror",
        action="store_false",
        help="no mirroring in the final validation (on by default, as nnU-Net and nnui-predict)",
    )
    p.add_argument(
        "--val_mirror_axes",
        type=mirroring.parse_axes,
        default=None,
        metavar="AXES",
        help="mirror only these patch axes in the final validation, e.g. 1,2 (3d: the "
        "in-plane flips, 4 passes instead of 8); default: every axis, as nnU-Net",
    )
    # nnui <= 0.2 mirrored only with --val-mirror; it is the default now (kept for scripts).
    p.add_argument("--val-mirror", dest="val_mirror", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "-pretrained_weights",
        default=None,
        metavar="FILE",
        help="start from the tensors of a safetensors file (an nnui checkpoint or a state "
        "dict) whose name and shape match; not with --c",
    )
    p.add_argument("--disable_checkpointing", action="store_true", help="write no checkpoints")


def _add_schedule_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int, default=1000, help="number of epochs (default 1000)")
    p.add_argument(
        "--iterations-per-epoch",
        type=int,
        default=250,
        help="training iterations per epoch (default 250)",
    )
    p.add_argument(
        "--val-iterations",
        type=int,
        default=50,
        help="validation iterations per epoch (default 50)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=50,
        help="write checkpoint_latest every N epochs (default 50)",
    )
    p.add_argument(
        "--seed", type=int, default=12345, help="seed of weights and sampling (default 12345)"
    )


def _add_execution_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-num_gpus",
        type=int,
        default=None,
        help="single-node DDP with N ranks (not under torchrun)",
    )
    p.add_argument("-device", default="cuda", help="cuda (default), cpu or mps")
    p.add_argument("--compile", action="store_true", help="torch.compile the network")
    p.add_argument(
        "--malloc",
        choices=allocator.MALLOC_CHOICES,
        default="auto",
        help="CPU only: auto = preload tcmalloc or jemalloc when installed (same speed, less "
        "memory than glibc), glibc = keep glibc's malloc",
    )
    p.add_argument(
        "--recompute-norm",
        choices=RECOMPUTE_CHOICES,
        default="auto",
        help="recompute norm+activation in backward: less than half the activation memory, "
        "same results, ~6-11%% more time (default auto: on for 3D on -device cpu, off for 2D "
        "and GPUs)",
    )
    p.add_argument("--precision", choices=precision.PRECISIONS, default="auto", help=precision.HELP)
    p.add_argument(
        "--num-workers",
        type=int,
        default=2,
        help="background data-loading workers per rank (default 2)",
    )
    p.add_argument(
        "--augment-on",
        choices=AUGMENT_CHOICES,
        default="device",
        help="where training augmentation runs: device (default) = the training device (a "
        "GPU augments between its steps; CPU runs augment in the loader threads), cpu = the "
        "loader threads on CPU for GPU runs too, nnU-Net's way (for cores to spare and a busy "
        "GPU)",
    )


def _add_root_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--raw",
        default=None,
        help="raw root, for the final validation against labelsTr (else $nnUNet_raw, else "
        "./nnui_data/raw)",
    )
    p.add_argument(
        "--preprocessed",
        default=None,
        help="preprocessed root (else $nnUNet_preprocessed, else ./nnui_data/preprocessed)",
    )
    p.add_argument(
        "--results",
        default=None,
        help="results root (else $nnUNet_results, else ./nnui_data/results)",
    )
