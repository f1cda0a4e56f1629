"""`nnui sbatch`: the command line that writes (and optionally submits) a SLURM job script
for one fold (the script itself: app/services/slurm/script.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from app.services.launch.engines import ENGINES, NNUI, NNUNET
from app.services.slurm.script import (
    JobSpec,
    UsageError,
    check_preprocessed,
    fold_folder,
    write_script,
)
from trainer.schema.exits import EXIT_OK, EXIT_USAGE
from trainer.schema.flags import with_close_flag
from trainer.schema.nnunet import NNUNET_EXT_DIR, NNUNET_EXT_ENV
from trainer.schema.tree import ROOT_ENVS


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing the whole usage block and exiting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--node` is not `--nodes`
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        known = [o for action in self._actions for o in action.option_strings]
        raise UsageError(f"{with_close_flag(message, known)} (see nnui sbatch --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="nnui sbatch",
        description="Write a SLURM job script that trains one fold with torchrun on N nodes; "
        "SLURM's USR1 before the time limit stops it gracefully, resubmitting resumes it.",
        epilog="Arguments after -- go to the trainer, e.g. -- --epochs 100.",
    )
    p.add_argument("dataset")
    p.add_argument("configuration")
    p.add_argument("fold", help="0-4 or all")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1, help="0 = CPU run (-device cpu)")
    p.add_argument("--procs-per-node", type=int, default=1, help="processes per node when CPU")
    p.add_argument("--time", required=True, dest="time_limit", help="HH:MM:SS or D-HH:MM:SS")
    p.add_argument(
        "--signal-lead",
        type=int,
        default=600,
        dest="signal_lead_s",
        help="seconds before the time limit that SLURM sends USR1 (default 600)",
    )
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--cpus-per-task", type=int)
    p.add_argument(
        "--rdzv-port",
        type=int,
        help="multi-node torchrun rendezvous port (default 20000 + job id mod 20000; one node: "
        "--standalone, a free port)",
    )
    p.add_argument("--output", default="nnui_slurm", help="folder for the script and job logs")
    p.add_argument("--submit", action="store_true", help="also submit it with sbatch")
    p.add_argument(
        "--requeue",
        action="store_true",
        help="at the USR1 lead the fold checkpoints and the job submits itself again "
        "(--c), so a long fold runs through time limits",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=NNUI,
        help="nnui (torchrun, N nodes) or nnunet (nnUNetv2_train -tr nnUNetTrainer_nnui, 1 node)",
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="do not check that the dataset and configuration are preprocessed here "
        "(for a cluster whose data lives elsewhere)",
    )
    return p


def spec_from_args(argv: list[str]) -> tuple[JobSpec, bool]:
    if "--" in argv:
        cut = argv.index("--")
        ours, trainer_args = argv[:cut], tuple(argv[cut + 1 :])
    else:
        ours, trainer_args = argv, ()
    args = _parser().parse_args(ours)
    env = {name: os.environ[name] for name in ROOT_ENVS.values() if os.environ.get(name)}
    if args.engine == NNUNET:
        env[NNUNET_EXT_ENV] = str(NNUNET_EXT_DIR)
    spec = JobSpec(
        dataset=args.dataset,
        configuration=args.configuration,
        fold=args.fold,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time_limit=args.time_limit,
        procs_per_node=args.procs_per_node,
        signal_lead_s=args.signal_lead_s,
        partition=args.partition,
        account=args.account,
        cpus_per_task=args.cpus_per_task,
        output_dir=Path(args.output).absolute(),
        workdir=Path.cwd(),
        rdzv_port=args.rdzv_port,
        trainer_args=trainer_args,
        env=env,
        engine=args.engine,
    )
    spec.validate()
    if not args.no_check:
        spec = replace(spec, run_folder=fold_folder(spec, check_preprocessed(spec)))
    spec = replace(spec, requeue=args.requeue)
    spec.validate()
    return spec, args.submit


def sbatch_main(argv: list[str]) -> int:
    try:
        spec, submit = spec_from_args(argv)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        path = write_script(spec)
    except OSError as error:
        where = error.filename or spec.output_dir
        print(
            f"error: cannot write the job script to {where}: {error.strerror or error}; "
            "choose another --output",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(path)
    if not submit:
        return EXIT_OK
    try:
        done = subprocess.run(["sbatch", str(path)], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        print("error: sbatch not found: is this a SLURM login node?", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode


def main() -> int:
    return sbatch_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
