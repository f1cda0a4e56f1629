"""`nnui`: the TUI (no subcommand) and its headless twin for scripts.

    nnui [--simulate-gpus N] [--readonly] [--no-mouse]       the dashboard
    nnui launch DATASET CONFIGURATION --folds 0,1 --gpus 0,1 [-- trainer flags]
    nnui status [--json] | stop JOB [--yes] | resume JOB | kill JOB --yes | sbatch ...

Exit codes: 0 ok, 1 refused by a safety check (reason printed), 2 usage error or unknown
job, 3 nothing to do (already stopped or finished).
"""

from __future__ import annotations

import argparse
import logging
import sys

from app.services.engines import ENGINES, NNUI

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_NOTHING = 0, 1, 2, 3

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
    group.add_argument("-v", "--verbose", action="store_true", default=False if top else default)


def _tui_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--readonly", action="store_true", help="TUI: watch only, no action keys")
    parser.add_argument("--no-mouse", action="store_true", help="TUI: disable mouse support")
    parser.add_argument(
        "--theme", choices=("dark", "light"), default="dark",
        help="TUI colours (t switches at run time; NO_COLOR=1 for none)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nnui",
        description="Assign nnU-Net-style cross-validation folds to GPUs, follow and stop them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(parser, top=True)
    _tui_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    status = sub.add_parser("status", help="table (or JSON) of the jobs")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--all", action="store_true", help="also jobs that ended > 7 days ago")
    _common(status, top=False)

    stop = sub.add_parser("stop", help="graceful stop (SIGUSR1 to the job's verified workers)")
    stop.add_argument("job", help="job id (or a unique prefix/suffix)")
    stop.add_argument("--yes", action="store_true", help="do not ask")
    _common(stop, top=False)

    resume = sub.add_parser("resume", help="continue a stopped job (--c) on the same GPUs")
    resume.add_argument("job")
    _common(resume, top=False)

    kill = sub.add_parser("kill", help="SIGTERM then SIGKILL to the job's own processes")
    kill.add_argument("job")
    kill.add_argument("--yes", action="store_true", help="required: kill loses the epoch")
    kill.add_argument("--grace", type=float, default=10.0, help="seconds before SIGKILL")
    _common(kill, top=False)

    launch = sub.add_parser(
        "launch",
        help="start trainings (trainer flags after --)",
        description="Start folds; trainer flags go after `--`, e.g. -- --epochs 3",
    )
    launch.add_argument("dataset", help="id (4, 004) or DatasetNNN_Name")
    launch.add_argument("configuration", help="e.g. 3d_fullres, 2d")
    launch.add_argument("--folds", required=True, help="comma list, e.g. 0,1 or all")
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
    launch.add_argument("--cpu", action="store_true", help="run on CPU (no GPU needed)")
    launch.add_argument("--c", dest="continue_training", action="store_true", help="resume")
    launch.add_argument("--dry-run", action="store_true", help="print the commands only")
    _common(launch, top=False)

    sub.add_parser("sbatch", help="write/submit a SLURM job script (see nnui sbatch --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sbatch"]:
        try:
            from app.services.slurm import sbatch_main
        except ImportError as error:
            print(f"error: nnui sbatch is not available ({error})", file=sys.stderr)
            return EXIT_USAGE
        return sbatch_main(argv[1:])
    trainer_args: list[str] = []
    if "--" in argv:
        index = argv.index("--")
        argv, trainer_args = argv[:index], argv[index + 1 :]
    parser = build_parser()
    options = parser.parse_args(argv)
    options.trainer_args = trainer_args
    logging.basicConfig(
        level=logging.DEBUG if options.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if trainer_args and options.command != "launch":
        print("error: trainer flags after -- only go with `nnui launch`", file=sys.stderr)
        return EXIT_USAGE
    if options.simulate_gpus is not None and options.simulate_gpus < 1:
        print("error: --simulate-gpus needs N >= 1", file=sys.stderr)
        return EXIT_USAGE
    problem = _state_dir_problem()
    if problem is not None:  # every command and the TUI keep their jobs there
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if options.command is None:
        try:
            from app.tui import run_tui
        except ImportError as error:
            print(f"error: the TUI is not available ({error})", file=sys.stderr)
            return EXIT_USAGE
        return run_tui(options)
    from app import cli

    try:
        return cli.run(options)
    except BrokenPipeError:  # `nnui status | head`
        sys.stderr.close()
        return EXIT_OK


def _state_dir_problem() -> str | None:
    """One line when $NNUI_STATE_DIR cannot be used (a file in its place, not writable)."""
    from app.services.registry import StateDirError, check_state_dir, default_state_dir

    try:
        check_state_dir(default_state_dir())
    except StateDirError as error:
        return str(error)
    return None


if __name__ == "__main__":
    sys.exit(main())
