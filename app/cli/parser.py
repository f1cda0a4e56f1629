"""The `nnui` command line: every subcommand, its flags and their help."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from app.services.launch.engines import ENGINES, NNUI
from trainer.schema.exits import EXIT_USAGE
from trainer.schema.flags import with_close_flag

EPILOG = """exit codes: 0 ok, 1 refused by a safety check (reason printed),
2 usage error or unknown job, 3 nothing to do (already stopped/finished).
Roots: --preprocessed/--results, else $nnUNet_preprocessed/$nnUNet_results, else ./nnui_data.
Jobs are kept per user in $NNUI_STATE_DIR (default ~/.local/state/nnui)."""


def _common(parser: argparse.ArgumentParser, top: bool) -> None:
    # Accepted before or after the subcommand; the subcommand copy must not reset the other.
    default = None if top else argparse.SUPPRESS
    group = parser.add_argument_group("common")
    group.add_argument("--preprocessed", default=default, help="preprocessed root")
    group.add_argument("--results", default=default, help="results root")
    group.add_argument("--raw", default=default, help="raw root")
    group.add_argument(
        "--simulate-gpus", type=int, metavar="N", default=default,
        help="a labelled simulated machine with N GPUs (jobs run with -device cpu)",
    )  # fmt: skip
    group.add_argument(
        "--simulate-busy", action="append", metavar="GPU:USER:GIB", default=default,
        help="the simulated machine: another user's process on GPU (repeatable)",
    )  # fmt: skip
    group.add_argument("-v", "--verbose", action="store_true", default=False if top else default)


def _version() -> str:
    """The installed distribution's version (a source tree that was never installed: 'dev')."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nnui")
    except PackageNotFoundError:
        return "dev (not installed)"


def _schedule_flags(launch: argparse.ArgumentParser) -> None:
    group = launch.add_argument_group("scheduling (the job's supervisor does it; nnui may exit)")
    group.add_argument(
        "--when-free", action="store_true",
        help="wait until a GPU of --gpus (or `--gpus any`) is free, claim it, then start",
    )  # fmt: skip
    group.add_argument("--min-free-gib", type=float, help="free: at least this much memory")
    group.add_argument("--max-util", type=int, metavar="P", help="free: utilisation <= P %%")
    group.add_argument("--share", action="store_true", help="free even beside other users")
    group.add_argument("--priority", type=int, default=0, help="higher starts first (FIFO)")
    group.add_argument(
        "--after-lowres", dest="after_previous_stage", action="store_true",
        help="a cascade (3d_cascade_fullres): each fold waits until the 3d_lowres folds "
        "that validated its cases are done",
    )  # fmt: skip
    group.add_argument(
        "--retries", type=int, default=0, metavar="N",
        help="restart with --c after an abnormal end, at most N times (default 0)",
    )  # fmt: skip
    group.add_argument(
        "--on-event", metavar="CMD",
        help="run CMD (no shell) when a job starts after waiting, restarts, finishes or fails",
    )  # fmt: skip
    group.add_argument(
        "--stall-action", choices=("none", "stop", "kill"), default="none",
        help="a stalled run (no event, no CPU for long): flag only (default), stop, or kill",
    )  # fmt: skip
    group.add_argument(
        "--stall-min-s", type=float, metavar="S",
        help="the stall rule's floor: never stalled sooner than S seconds (default 300)",
    )  # fmt: skip


def _manners_flags(launch: argparse.ArgumentParser) -> None:
    group = launch.add_argument_group("shared-box manners")
    group.add_argument("--yes", action="store_true", help="start on GPUs already in use")
    group.add_argument(
        "--nice", type=int, metavar="N",
        help="the trainer's nice value (default: the user's own, not nnui's)",
    )  # fmt: skip
    group.add_argument(
        "--threads", type=int, metavar="T", help="CPU threads per trainer (OMP_NUM_THREADS)"
    )
    group.add_argument(
        "--oversubscribe", action="store_true",
        help="--cpu: start every fold at once although they share the CPU slots (cores // "
        "threads per job; slower, the expected slowdown is printed)",
    )  # fmt: skip


def _schedule_parsers(sub: argparse._SubParsersAction) -> None:
    watch = sub.add_parser(
        "watch", help="print job events (started after waiting, restarted, finished, failed)"
    )
    watch.add_argument("--json", action="store_true", help="one JSON object per line")
    watch.add_argument("--all", action="store_true", help="from the first event, not from now")
    _common(watch, top=False)
    cv = sub.add_parser("cv", help="the cross-validation view: folds 0-4, Dice, GPU-hours, ETA")
    cv.add_argument("--json", action="store_true", help="machine-readable output")
    _common(cv, top=False)
    priority = sub.add_parser("priority", help="re-order a job waiting for a GPU")
    priority.add_argument("job")
    priority.add_argument("priority", type=int, help="higher starts first (default 0)")
    _common(priority, top=False)


def _tui_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--readonly", action="store_true", help="TUI: watch only, no action keys")
    parser.add_argument("--no-mouse", action="store_true", help="TUI: disable mouse support")
    parser.add_argument(
        "--theme", choices=("dark", "light"), default="dark",
        help="TUI colours (t switches at run time; NO_COLOR=1 for none)",
    )  # fmt: skip
    parser.add_argument(
        "--no-bell", action="store_true", help="TUI: no bell when a job finishes/fails/stalls"
    )
    parser.add_argument("--version", action="version", version=f"nnui {_version()}")


def _history_parsers(sub: argparse._SubParsersAction) -> None:
    """`nnui export` and `nnui forget` (app/cli/history.py)."""
    export = sub.add_parser("export", help="write a job's curves as JOB_curves.csv and .png")
    export.add_argument("job", help="job id (or a unique prefix/suffix)")
    export.add_argument("-o", "--output", metavar="DIR", help="folder (default: current)")
    _common(export, top=False)

    forget = sub.add_parser("forget", help="hide an ended job from the lists (results kept)")
    forget.add_argument("job", help="job id (or a unique prefix/suffix)")
    forget.add_argument("--undo", action="store_true", help="list the job again")
    _common(forget, top=False)


def _launch_parser(sub: argparse._SubParsersAction) -> None:
    launch = sub.add_parser(
        "launch",
        help="start trainings (trainer flags after --)",
        description="Start folds; trainer flags go after `--`, e.g. -- --epochs 3",
    )
    launch.add_argument("dataset", help="id (4, 004) or DatasetNNN_Name")
    launch.add_argument("configuration", help="e.g. 3d_fullres, 2d")
    launch.add_argument("--folds", required=True, help="e.g. 0,1 or 0-4 or all")
    launch.add_argument("--gpus", default="", help="comma list of GPU indices, e.g. 0,1")
    launch.add_argument("--ddp", choices=("spawn", "torchrun"), help="one fold on all --gpus")
    launch.add_argument("--sequential", action="store_true", help="folds on a GPU in turn")
    launch.add_argument(
        "--engine",
        choices=ENGINES,
        default=NNUI,
        help="nnui (nnui's trainer, default) or nnunet (the installed nnU-Net v2 with nnui's "
        "stop and events: nnUNetv2_train -tr nnUNetTrainer_nnui)",
    )
    launch.add_argument(
        "--cpu", action="store_true",
        help="run on CPU (no GPU needed): one fold per CPU slot at a time, the rest wait",
    )  # fmt: skip
    launch.add_argument("--c", dest="continue_training", action="store_true", help="resume")
    launch.add_argument("--dry-run", action="store_true", help="print the commands only")
    _schedule_flags(launch)
    _manners_flags(launch)
    _cluster_flags(launch)
    _common(launch, top=False)


def _cluster_flags(launch: argparse.ArgumentParser) -> None:
    group = launch.add_argument_group("a SLURM cluster (one nnui sbatch job per fold)")
    group.add_argument("--slurm", action="store_true", help="submit the folds to SLURM")
    group.add_argument("--time", dest="slurm_time", metavar="T", help="[D-]HH:MM:SS per job")
    group.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    group.add_argument("--account", help="SLURM account")
    group.add_argument("--nodes", type=int, default=1, help="nodes per fold (multi-node DDP)")
    group.add_argument(
        "--gpus-per-node", type=int, metavar="G", help="GPUs per node (default 1; --cpu: 0)"
    )
    group.add_argument("--cpus-per-task", type=int, metavar="N", help="CPUs per node's task")
    group.add_argument(
        "--procs-per-node", type=int, default=1, metavar="N", help="--cpu: processes per node"
    )
    group.add_argument(
        "--signal-lead", type=int, default=600, metavar="S",
        help="SLURM's USR1 S seconds before --time: the fold stops gracefully (default 600)",
    )  # fmt: skip
    group.add_argument(
        "--requeue", action="store_true",
        help="at that USR1 the fold checkpoints and its job submits itself again (--c)",
    )  # fmt: skip
    group.add_argument(
        "--slurm-output", metavar="DIR", default="nnui_slurm",
        help="folder for the job scripts and SLURM logs (default ./nnui_slurm)",
    )  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """Flags spelled out in full (no prefix matching: `--epoch` is not `--epochs`), one-line
    errors naming the close match; the subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {with_close_flag(message, _flags(self))} (see {self.prog} --help)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(EXIT_USAGE)


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of a parser and its subcommands (extra arguments are reported by the top)."""
    flags: list[str] = []
    for action in parser._actions:
        flags += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                flags += _flags(child)
    return flags


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nnui",
        description="Assign nnU-Net-style cross-validation folds to GPUs, follow and stop them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(parser, top=True)
    _tui_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    status = sub.add_parser("status", help="table (or JSON) of the jobs")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--all", action="store_true", help="also jobs ended >7 days ago, forgotten")
    _common(status, top=False)

    stop = sub.add_parser("stop", help="graceful stop (SIGUSR1 to the job's verified workers)")
    stop.add_argument("job", help="job id (or a unique prefix/suffix)")
    stop.add_argument("--yes", action="store_true", help="do not ask")
    _common(stop, top=False)

    resume = sub.add_parser("resume", help="continue a stopped job (--c) on the same GPUs")
    resume.add_argument("job")
    resume.add_argument("--yes", action="store_true", help="resume on GPUs already in use")
    _common(resume, top=False)

    kill = sub.add_parser("kill", help="SIGTERM then SIGKILL to the job's own processes")
    kill.add_argument("job")
    kill.add_argument("--yes", action="store_true", help="required: kill loses the epoch")
    kill.add_argument("--grace", type=float, default=10.0, help="seconds before SIGKILL")
    _common(kill, top=False)

    _launch_parser(sub)
    _predict_parser(sub)
    _schedule_parsers(sub)
    _history_parsers(sub)

    sub.add_parser("sbatch", help="write/submit a SLURM job script (see nnui sbatch --help)")
    return parser


def _predict_parser(sub: argparse._SubParsersAction) -> None:
    predict = sub.add_parser(
        "predict",
        help="segment a folder with trained folds, one part of the cases per GPU",
        description="Start one nnui-predict job per GPU (-num_parts/-part_id), detached "
        "and stoppable like trainings; other nnui-predict flags go after `--`, e.g. "
        "-- -step_size 0.75 --postprocess FILE",
    )
    predict.add_argument("-i", dest="input", required=True, help="folder of CASE_0000 images")
    predict.add_argument("-o", dest="output", required=True, help="output folder (not -i)")
    predict.add_argument("-d", dest="dataset", required=True, help="id or DatasetNNN_Name")
    predict.add_argument("-c", dest="configuration", required=True, help="e.g. 3d_fullres")
    predict.add_argument("-f", dest="folds", nargs="+", default=["0", "1", "2", "3", "4"],
                         help="folds to average (default 0 1 2 3 4)")  # fmt: skip
    predict.add_argument("-chk", dest="checkpoint", help="checkpoint_final (default) or _best")
    predict.add_argument("--disable_tta", action="store_true", help="no mirroring")
    predict.add_argument("--save_probabilities", action="store_true", help="also CASE.npz")
    predict.add_argument("--continue_prediction", action="store_true", help="skip done cases")
    predict.add_argument("--gpus", default="", help="comma list: one part per GPU, e.g. 0,1")
    predict.add_argument("--cpu", action="store_true", help="one part on the CPU")
    predict.add_argument("--dry-run", action="store_true", help="print the commands only")
    predict.add_argument("--yes", action="store_true", help="do not ask about busy GPUs")
    _common(predict, top=False)
