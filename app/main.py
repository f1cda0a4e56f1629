"""`nnui`: the TUI (no subcommand) and its headless twin for scripts.

    nnui [--simulate-gpus N] [--readonly] [--no-mouse]       the dashboard
    nnui launch DATASET CONFIGURATION --folds 0,1 --gpus 0,1 [-- trainer flags]
    nnui predict -i IN -o OUT -d DATASET -c CONFIGURATION -f 0 1 --gpus 0,1
    nnui status [--json] | stop JOB [--yes] | resume JOB | kill JOB --yes | sbatch ...
    nnui watch [--json] [--all]                               job events, as they happen
    nnui priority JOB N                                       re-order a waiting job
    nnui export JOB [-o DIR] | forget JOB [--undo]

Exit codes: 0 ok, 1 refused by a safety check (reason printed), 2 usage error or unknown
job, 3 nothing to do (already stopped or finished).
"""

from __future__ import annotations

import argparse
import logging
import sys

from app.cli.parser import build_parser
from trainer.schema.exits import EXIT_OK, EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sbatch"]:
        try:
            from app.cli.sbatch import sbatch_main
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
    if trainer_args and options.command not in ("launch", "predict"):
        print("error: flags after -- only go with `nnui launch` and `nnui predict`",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if options.simulate_gpus is not None and options.simulate_gpus < 1:
        print("error: --simulate-gpus needs N >= 1", file=sys.stderr)
        return EXIT_USAGE
    problem = _simulated_busy_problem(options)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
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
    from app.cli.commands import run

    try:
        return run(options)
    except BrokenPipeError:  # `nnui status | head`
        sys.stderr.close()
        return EXIT_OK


def _simulated_busy_problem(options: argparse.Namespace) -> str | None:
    """--simulate-busy: written where the simulated GPUs (and the jobs' supervisors) read it."""
    if not options.simulate_busy:
        return None
    if options.simulate_gpus is None:
        return "--simulate-busy goes with --simulate-gpus N"
    from app.services.jobs.registry import default_state_dir
    from app.services.machine.simulate_busy import install

    try:
        install(options.simulate_busy, options.simulate_gpus, default_state_dir())
    except (ValueError, OSError) as error:
        return str(error)
    return None


def _state_dir_problem() -> str | None:
    """One line when $NNUI_STATE_DIR cannot be used (a file in its place, not writable)."""
    from app.services.jobs.registry import StateDirError, check_state_dir, default_state_dir

    try:
        check_state_dir(default_state_dir())
    except StateDirError as error:
        return str(error)
    return None


if __name__ == "__main__":
    sys.exit(main())
