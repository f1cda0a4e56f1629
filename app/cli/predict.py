"""`nnui predict -i IN -o OUT -d D -c C [-f F ...] --gpus 0,1 [-- nnui-predict flags]`: one
supervised prediction job per GPU, each a part of the cases (app/services/launch/prediction.py).

Every check runs before anything starts: a usage mistake (no cases in IN, OUT = IN, a fold
without its checkpoint, an unknown GPU) is one `error:` line and exit 2, with no job
registered; a prediction already writing to OUT is a refusal (exit 1). Jobs are followed
with `nnui status`, stopped with `nnui stop JOB` (after the current case) and continued
with `nnui resume JOB` (--continue_prediction).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from app.cli.common import confirm, error, machine_snapshot, roots_of
from app.cli.launch import chosen_gpus, report_checks, start_predictions
from app.services.jobs.registry import Registry
from app.services.launch import launcher, prediction
from app.services.launch.trainer_flags import flag_value
from trainer.schema.exits import EXIT_OK, EXIT_USAGE


def predict_args(options: argparse.Namespace) -> list[str]:
    """The nnui-predict flags of this command line (named ones first, then after --)."""
    args: list[str] = []
    if options.checkpoint:
        args += ["-chk", options.checkpoint]
    for name in ("disable_tta", "save_probabilities", "continue_prediction"):
        if getattr(options, name):
            args.append(f"--{name}")
    return [*args, *options.trainer_args]


def request_of(options: argparse.Namespace, gpus: list[str]) -> prediction.PredictRequest:
    simulated = options.simulate_gpus is not None
    return prediction.PredictRequest(
        input_dir=Path(options.input),
        output_dir=Path(options.output),
        dataset=options.dataset,
        configuration=options.configuration,
        folds=tuple(options.folds),
        gpus=tuple(gpus),
        device="cpu" if options.cpu or simulated else "cuda",
        simulated=simulated,
        predict_args=tuple(predict_args(options)),
    )


def cmd_predict(options: argparse.Namespace, registry: Registry) -> int:
    gpus, problem = chosen_gpus(options)
    if problem is not None:
        return error(problem, EXIT_USAGE)
    if flag_value(options.trainer_args, "--events") is not None:
        return error("--events is nnui's own (each job writes to its folder)", EXIT_USAGE)
    request = request_of(options, gpus)
    roots = roots_of(options)
    real_gpus = request.device == "cuda" and not request.simulated
    snapshot = machine_snapshot(options) if real_gpus else None
    checks = prediction.check_prediction(request, roots, registry, snapshot)
    refused = report_checks(checks)
    if refused is not None:
        return refused
    plans = prediction.plan_prediction(request, roots, registry, checks.dataset_name)
    if options.dry_run:
        for plan in plans:
            print(launcher.preview(plan))
        return EXIT_OK
    if checks.warnings and not options.yes and not confirm("start anyway?"):
        print("not started")
        return EXIT_OK
    return start_predictions(plans, registry)
