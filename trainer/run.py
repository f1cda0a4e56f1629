"""`nnui-train DATASET CONFIGURATION FOLD ...` (also `python -m trainer`, `torchrun -m trainer`).

The CLI process checks every input once (a user mistake is one `error: ...` line and exit
2), resolves a TrainConfig and hands it to trainer.training.launch.run_distributed, which runs
trainer.training.worker.worker in this process, in spawned ranks, or under a launcher.

Every entry point runs this module's top first (the console script imports main from
here, `python -m trainer` and torchrun's `-m trainer` via trainer/__main__.py, spawned ranks
when they re-import the main script), so its first statement installs the SIGUSR1 flag
handler, before any other import: a stop request from then on is kept, not fatal (the
interpreter's own start-up before it is the one unavoidable window; docs/training.md).
`import torch` stays out of the top level.
"""

# ruff: noqa: E402  (the SIGUSR1 handler goes in before the other imports)
from __future__ import annotations

from trainer import stop

stop.install_at_start()

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from trainer import allocator
from trainer.cli import usage_error
from trainer.inference import mirroring
from trainer.schema.exits import EXIT_REFUSED
from trainer.schema.tree import DEFAULT_PLANS, DEFAULT_TRAINER
from trainer.training import openmp
from trainer.training.train_args import build_parser

__all__ = ["UsageError", "main", "resolve_config"]

log = logging.getLogger("trainer.run")


class UsageError(ValueError):
    """A mistake the user fixes with a flag or a command: one line, exit 2."""


def resolve_config(args: argparse.Namespace, argv: list[str]) -> Any:
    """Validate the inputs against the file system and return a TrainConfig (raises UsageError)."""
    from trainer.schema.tree import find_dataset, resolve_roots
    from trainer.schema.tree import run_dir as schema_run_dir
    from trainer.training import launch

    roots = resolve_roots(raw=args.raw, preprocessed=args.preprocessed, results=args.results)
    dataset_name = find_dataset(roots.preprocessed, args.dataset)
    dataset_dir = roots.preprocessed / dataset_name
    run_dir = schema_run_dir(
        roots.results, dataset_name, args.configuration, args.fold, args.trainer, args.plans
    )
    continuing = args.continue_training or args.validation_only
    _check_shared_tree(run_dir, args.trainer, args.plans, continuing)
    plans, cplan = _load_configuration(dataset_dir, dataset_name, args)
    data_dir = dataset_dir / cplan.data_identifier
    config = _make_config(args, argv, dataset_name, dataset_dir, run_dir, plans)
    _check_cases_and_fold(data_dir, dataset_dir, config.fold)
    _check_previous_stage(config, cplan, data_dir, dataset_dir)
    _check_device_and_batch(config, cplan.batch_size)
    if config.device_type == "cpu" and not config.validation_only and launch.is_main_process():
        from trainer.planning.cpu import cpu_epoch_note

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        note = cpu_epoch_note(cplan, plans.num_classes, config.iterations_per_epoch, cores)
        if note:
            print(note, file=sys.stderr, flush=True)
    if not launch.is_main_process():
        # Rank 0 checks and picks the checkpoint and hands it over (other nodes may not
        # even have the file); nothing is written under results by this process.
        return config
    if config.validation_only:
        _check_validation_checkpoint(config)
    elif config.continue_training:
        config = _find_resume_checkpoint(config)
    elif config.pretrained_weights:
        from trainer.checkpoint.pretrained import check_pretrained_file

        check_pretrained_file(Path(config.pretrained_weights), plans, cplan)
    config = _check_raw_data(config, roots.raw / dataset_name, data_dir)
    _check_writable(Path(config.run_dir))  # last: a refused run leaves no empty folder behind
    return config


def _load_configuration(dataset_dir: Path, dataset_name: str, args: argparse.Namespace):
    """(plans, configuration plan), the configuration preprocessed (else UsageError)."""
    from trainer.planning.plans import load_plans

    try:
        plans = load_plans(dataset_dir, args.plans)
    except FileNotFoundError as error:  # its message already says to run nnui-preprocess
        raise UsageError(f"no plans {args.plans!r} for {dataset_name}: {error}") from error
    try:
        cplan = plans.configuration(args.configuration)
    except (KeyError, ValueError) as error:
        raise UsageError(f"{error}") from error
    mirroring.check_axes(args.val_mirror_axes, len(cplan.patch_size), "--val_mirror_axes")
    data_dir = dataset_dir / cplan.data_identifier
    if not data_dir.is_dir() or not any(data_dir.iterdir()):
        raise UsageError(
            f"configuration {args.configuration} of {dataset_name} is not preprocessed "
            f"({data_dir} is missing); run nnui-preprocess {args.dataset} -c {args.configuration}"
        )
    return plans, cplan


def _make_config(args: argparse.Namespace, argv: list[str], dataset_name: str,
                 dataset_dir: Path, run_dir: Path, plans: Any) -> Any:  # fmt: skip
    from trainer.training.config import TrainConfig

    pretrained = args.pretrained_weights
    return TrainConfig(
        dataset_name=dataset_name,
        configuration=args.configuration,
        fold=args.fold,
        preprocessed_dataset_dir=str(dataset_dir),
        run_dir=str(run_dir),
        plans_identity=plans.identity_of(args.configuration),
        trainer=args.trainer,
        plans_name=args.plans,
        num_epochs=args.epochs,
        iterations_per_epoch=args.iterations_per_epoch,
        val_iterations=args.val_iterations,
        save_every=args.save_every,
        seed=args.seed,
        device_type=args.device,
        num_gpus=args.num_gpus,
        compile=args.compile,
        recompute_norm=args.recompute_norm,
        precision=args.precision,
        num_workers=args.num_workers,
        augment_on=args.augment_on,
        npz=args.npz,
        continue_training=args.continue_training,
        validation_only=args.validation_only,
        val_best=args.val_best,
        val_mirror=args.val_mirror,
        val_mirror_axes=args.val_mirror_axes,
        disable_checkpointing=args.disable_checkpointing,
        pretrained_weights=str(Path(pretrained).absolute()) if pretrained else None,
        argv=argv,
    )


def _check_raw_data(config: Any, raw_dataset: Path, data_dir: Path) -> Any:
    """The raw files final validation needs (labelsTr and channel 0 of each validation case),
    checked now so that a long training does not fail at its end. A --val run refuses
    without them; a training run says once that it will score in the preprocessed space."""
    from trainer.training.final_validation import RawDataMissing, check_raw_cases

    try:
        check_raw_cases(raw_dataset, data_dir, config.fold, config.npz)
    except RawDataMissing as error:
        if config.validation_only:
            raise UsageError(f"--val: {error}") from error
        log.warning("warning: %s; final validation will score in the preprocessed space "
                    "and write no segmentations", error)  # fmt: skip
        return config
    return config.replace(raw_dataset_dir=str(raw_dataset))


def _check_validation_checkpoint(config: Any) -> None:
    from trainer.checkpoint import store
    from trainer.checkpoint.format import CheckpointError
    from trainer.schema.tree import checkpoint_file

    kind = "best" if config.val_best else "final"
    path = Path(config.run_dir) / checkpoint_file(kind)
    if not path.exists():
        hint = " (or drop --val_best)" if config.val_best else ""
        raise UsageError(f"--val needs {path}; train first{hint}")
    try:
        metadata = store.read_metadata(path)
    except CheckpointError as error:
        raise UsageError(f"cannot validate: {error}") from error
    store.check_identity(
        store.CheckpointInfo(path, kind, metadata["epoch_next"], metadata), config.identity()
    )


def _find_resume_checkpoint(config: Any) -> Any:
    from trainer.checkpoint import store

    run_dir = Path(config.run_dir)
    info = store.find_resume(run_dir, config.identity(), config.num_epochs)
    if info is None:
        log.warning("--c: no valid checkpoint in %s, starting fresh", run_dir)
        return config
    return config.replace(resume_checkpoint=str(info.path))


def _check_shared_tree(run_dir: Path, trainer: str, plans: str, continuing: bool) -> None:
    """One tree, two tools: never write into nnU-Net's run folders, never start anything
    new under nnU-Net's names (nnui 0.1's run folders are only continued)."""
    from trainer import legacy
    from trainer.schema.nnunet import nnunet_files

    theirs = nnunet_files(run_dir)
    if theirs:
        raise UsageError(
            f"{run_dir} is an nnU-Net run folder ({', '.join(theirs)}); nnui will not write "
            f"there (nnui trains as -tr {DEFAULT_TRAINER} -p {DEFAULT_PLANS}, the defaults)"
        )
    refusal = legacy.new_run_refusal(run_dir, trainer, plans, continuing)
    if refusal:
        raise UsageError(refusal)


_created_folders: list[Path] = []  # made by _check_writable: removed again by a refusal


def _check_writable(run_dir: Path) -> None:
    """The run folder exists and accepts files (else one line now, not a traceback later)."""
    missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _created_folders[:] = missing
    except OSError as error:
        raise UsageError(f"cannot create the run folder {run_dir}: {error.strerror or error}; "
                         "pass a writable --results or set nnUNet_results") from error  # fmt: skip
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UsageError(f"the run folder {run_dir} is not writable; pass a writable --results "
                         "or set nnUNet_results")  # fmt: skip


def _remove_created_if_empty() -> None:
    """A run refused after its folder was made leaves no empty fold_* folder behind."""
    for folder in _created_folders:  # deepest first
        try:
            folder.rmdir()  # only when empty: anything written in it stays
        except OSError:
            break
    _created_folders.clear()


def _check_cases_and_fold(data_dir: Path, dataset_dir: Path, fold: str) -> None:
    """splits_final.json readable, the fold in it, and the fold's cases preprocessed.

    Runs in every rank's CLI process (also under torchrun), before anything is written.
    """
    from trainer.data.dataset import PreprocessedCases
    from trainer.planning.splits import SPLITS_FILE, load_or_create_splits

    try:
        cases = PreprocessedCases(data_dir)
        splits = load_or_create_splits(dataset_dir, cases.case_ids, write=False)
    except (OSError, ValueError) as error:
        raise UsageError(str(error)) from error
    if fold == "all":
        wanted = list(cases.case_ids)
    elif int(fold) >= len(splits):
        raise UsageError(
            f"fold {fold} does not exist: {dataset_dir / SPLITS_FILE} has {len(splits)} "
            f"fold(s); choose 0-{len(splits) - 1} or 'all'"
        )
    else:
        wanted = [*splits[int(fold)]["train"], *splits[int(fold)]["val"]]
    missing_fn = getattr(cases, "missing_case_ids", None)
    missing = set(missing_fn()) if missing_fn is not None else set()
    missing |= set(wanted) - set(cases.case_ids)
    for case_id in wanted:
        if case_id in missing:
            source = "the dataset" if fold == "all" else SPLITS_FILE
            raise UsageError(
                f"case {case_id} listed in {source} has no preprocessed files in {data_dir}: "
                "rerun nnui-preprocess"
            )


def _check_previous_stage(config: Any, cplan: Any, data_dir: Path, dataset_dir: Path) -> None:
    """A cascade fold needs the previous stage's segmentations of every case it trains and
    validates on: one line naming the folds of that stage to train first."""
    if not cplan.previous_stage:
        return
    from trainer.data.cascade import CascadeError, check_inputs, previous_stage_folder
    from trainer.data.dataset import PreprocessedCases
    from trainer.planning.splits import fold_cases, load_or_create_splits

    cases = PreprocessedCases(data_dir)
    splits = load_or_create_splits(dataset_dir, cases.case_ids, write=False)
    train_ids, val_ids = fold_cases(splits, config.fold, cases.case_ids)
    try:
        folder = previous_stage_folder(Path(config.run_dir), cplan)
        check_inputs(folder, [*train_ids, *val_ids], splits, cplan)
    except CascadeError as error:
        raise UsageError(str(error)) from error


def _check_device_and_batch(config: Any, global_batch: int) -> None:
    from trainer.training import batch, launch

    launcher = launch.detect_external_launcher()
    launch.check_num_gpus(config.num_gpus, launcher)
    import torch

    if config.device_type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("CUDA is not available on this machine; pass -device cpu")
        if (config.num_gpus or 1) > torch.cuda.device_count():
            raise UsageError(
                f"-num_gpus {config.num_gpus} but only {torch.cuda.device_count()} CUDA device(s) "
                "are visible"
            )
    if config.device_type == "mps" and not torch.backends.mps.is_available():
        raise UsageError("MPS is not available on this machine; pass -device cpu")
    world_size = config.num_gpus or 1
    if launcher is not None:
        world_size = launch.env_rank_and_size()[1] or 1
    batch.split_global_batch(global_batch, world_size)  # ValueError if G < W


def main(argv: list[str] | None = None) -> int:
    stop.install_at_start()  # again: a caller in Python may have replaced it since import
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if as_program:  # not when called from Python (tests): the caller owns the process
        allocator.reexec_with_caching_allocator(args.device, args.malloc)
        openmp.limit_spinning(args.device)  # before torch is imported
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        config = resolve_config(args, argv)
    except ValueError as error:  # UsageError, DatasetNotFound, IdentityMismatch, config checks
        return usage_error(str(error))
    from trainer.training import fold_lock, launch
    from trainer.training.worker import worker

    try:
        if launch.is_main_process():
            _own_fold(config, args.retrain)
        return launch.run_distributed(worker, config.to_dict(), config.num_gpus, config.device_type)
    except Refused as error:
        fold_lock.discard_created()
        _remove_created_if_empty()
        sys.stderr.write(f"error: {error}\n")
        return EXIT_REFUSED
    except ValueError as error:  # raised before any rank starts: a user mistake
        fold_lock.discard_created()
        _remove_created_if_empty()
        return usage_error(str(error))
    finally:
        fold_lock.release()  # only matters in-process (tests): an exit releases it anyway


class Refused(RuntimeError):
    """A safety rule refused the run (one line, exit 1): the fold is owned or finished."""


def _own_fold(config: Any, retrain: bool) -> None:
    """Take the fold folder's lock (one trainer per folder), then, under it, refuse to start
    a finished fold afresh unless --retrain: the same rule and words as `nnui launch`."""
    from trainer.schema.status import State, read_status
    from trainer.schema.tree import checkpoint_file
    from trainer.training import fold_lock

    run_dir = Path(config.run_dir)
    try:
        fold_lock.acquire(run_dir, [sys.argv[0], *config.argv], config.num_gpus)
    except fold_lock.FoldBusy as error:
        raise Refused(str(error)) from None
    if config.continue_training or config.validation_only or retrain:
        return
    status = read_status(run_dir)
    finished = (status is not None and status.state == State.FINISHED) or (
        run_dir / checkpoint_file("final")
    ).is_file()
    if finished:
        raise Refused(
            f"fold {config.fold} already finished training in {run_dir}; move that folder to "
            "train it again, or pass --retrain"
        )


if __name__ == "__main__":
    sys.exit(main())
