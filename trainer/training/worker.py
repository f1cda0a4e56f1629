"""What every rank runs: build model, data and optimiser from the plans, then train/validate.

`worker(topology, payload)` is the worker_fn given to trainer.training.launch.run_distributed;
the payload is TrainConfig.to_dict(). Returns the process exit code (0 on success and on a
graceful stop). Heavy imports happen inside, after the SIGUSR1 handler is installed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from trainer import stop
from trainer.checkpoint.format import CheckpointError
from trainer.inference import mirroring
from trainer.schema.atomic import atomic_write_text
from trainer.schema.events import Kind
from trainer.schema.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, exit_for_signal
from trainer.schema.status import State
from trainer.schema.tree import CONFIG_FILE, checkpoint_file
from trainer.training.config import TrainConfig
from trainer.training.events import RunRecorder

if TYPE_CHECKING:  # imported where used: each of them pulls in torch
    import torch

    from trainer.data.dataset import PreprocessedCases
    from trainer.planning.plans import ConfigurationPlan, Plans
    from trainer.training.batch import RankBatch
    from trainer.training.launch import Topology
    from trainer.training.loop import Checkpointer, LoopState, Trainee

log = logging.getLogger("trainer")


def setup_logging(global_rank: int) -> None:
    # StreamHandler writes each record with one write(): lines of several ranks do not mix.
    handler = logging.StreamHandler(sys.stdout)
    fmt = f"%(asctime)s [rank {global_rank}] %(message)s"
    handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Rank 0 tells the story; the others speak up only for warnings and errors.
    root.setLevel(logging.INFO if global_rank == 0 else logging.WARNING)


def worker(topology: Topology, payload: dict[str, Any]) -> int:
    stop.install()
    stop.install_termination()
    config = TrainConfig.from_dict(payload)
    setup_logging(topology.global_rank)
    recorder = RunRecorder(Path(config.run_dir), topology.is_main, config.num_epochs)
    try:
        return _train_and_validate(topology, config, recorder)
    except BaseException as error:  # record why, then let the exit code say it
        message = f"{type(error).__name__}: {error}"
        log.error("failed: %s", message)
        recorder.failed(message, traceback.format_exc())
        if isinstance(error, KeyboardInterrupt):
            return EXIT_INTERRUPTED
        if isinstance(error, stop.Terminated):
            return exit_for_signal(error.signum)
        return EXIT_FAILED
    finally:
        recorder.close()
        # Past this point a stop has nothing left to do. Python's shutdown puts the default
        # action back for a signal with a Python handler (SIGUSR1's kills), but keeps an
        # ignored one ignored: a stop sent to every rank may reach one after another rank's
        # stop already ended the run (short epochs, a sender descheduled between its kills).
        stop.ignore()


def _train_and_validate(topology: Topology, config: TrainConfig, recorder: RunRecorder) -> int:
    from trainer.data.dataset import PreprocessedCases
    from trainer.planning.plans import load_plans
    from trainer.planning.splits import fold_cases, load_or_create_splits
    from trainer.training import batch, distributed, launch
    from trainer.training.loop import Checkpointer, record_stop

    device = launch.device_for(topology, config.device_type)
    _remove_stale_tmp(config, topology)
    dataset_dir = Path(config.preprocessed_dataset_dir)
    plans = load_plans(dataset_dir, config.plans_name)
    cplan = plans.configuration(config.configuration)
    cases = PreprocessedCases(dataset_dir / cplan.data_identifier)
    splits = load_or_create_splits(dataset_dir, cases.case_ids, write=topology.is_main)
    distributed.barrier()
    train_ids, val_ids = fold_cases(splits, config.fold, cases.case_ids)
    cases = _stage_cases(config, plans, cplan, cases, [*train_ids, *val_ids], splits)
    rank_batches = batch.split_global_batch(
        cplan.batch_size, topology.world_size, config.oversample_foreground
    )
    rank_batch = rank_batches[topology.global_rank]
    _record_start(config, topology, recorder, device, rank_batch, plans.label_spec.class_names())
    log.info(
        "%s %s fold %s: %d train / %d val cases, patch %s, batch %d on %s (world size %d)",
        config.dataset_name, config.configuration, config.fold, len(train_ids), len(val_ids),
        list(cplan.patch_size), rank_batch.batch_size, device, topology.world_size,
    )  # fmt: skip
    if device.type == "cpu":
        from trainer import allocator

        log.info("CPU malloc: %s", allocator.describe())
    weight_ce = batch.loss_weight([b.batch_size for b in rank_batches], topology.global_rank)
    trainee = _build_trainee(config, plans, cplan, device, weight_ce)
    # Restore before DDP wraps the model: its constructor then broadcasts identical weights.
    state = _restore(config, topology, trainee, recorder)
    _wrap(config, topology, trainee)
    checkpointer = Checkpointer(config, trainee, recorder, topology.is_main)

    if not config.validation_only:
        # A SIGUSR1 during start-up: stop before the first epoch, resumable as it is.
        if distributed.stop_agreed(stop.requested(), device):
            already_latest = state.resumed_kind == "latest"
            write_latest = state.epoch_next > 0 and not already_latest
            record_stop(state, state.epoch_next - 1, recorder, checkpointer, write_latest)
            return EXIT_OK
        trains = state.epoch_next < config.num_epochs
        if trains:
            streams = {"train": train_ids, "val": val_ids}
            if not _train(config, topology, trainee, state, cases, streams, cplan, rank_batch,
                          recorder, checkpointer):  # fmt: skip
                return EXIT_OK  # graceful stop
        if trains or state.resumed_kind != "final":
            checkpointer.save("final", state)
        recorder.status(epoch=state.epoch_next)

    _final_validation(config, topology, trainee, cases, val_ids, plans, cplan, recorder)
    recorder.event(Kind.FINISHED, epoch=state.epoch_next - 1)
    recorder.status(State.FINISHED, epoch=state.epoch_next)
    log.info("finished")
    return EXIT_OK


def _stage_cases(
    config: TrainConfig,
    plans: Plans,
    cplan: ConfigurationPlan,
    cases: PreprocessedCases,
    case_ids: list[str],
    splits: list,
) -> PreprocessedCases:
    """3d_cascade_fullres: the cases with the previous stage's segmentations; else `cases`."""
    from trainer.data.cascade import CascadeCases, check_inputs, previous_stage_folder

    if not cplan.previous_stage:
        return cases

    folder = previous_stage_folder(Path(config.run_dir), cplan)
    check_inputs(folder, case_ids, splits, cplan)  # the CLI checked; a fold may have gone
    return CascadeCases(cases.folder, folder, plans.label_spec)


def _remove_stale_tmp(config: TrainConfig, topology: Topology) -> None:
    """Rank 0, before writing anything: what a killed write left in the run folder."""
    from trainer.checkpoint.atomic import remove_stale_tmp

    if not topology.is_main:
        return
    removed = remove_stale_tmp(Path(config.run_dir))
    if removed:
        log.info("removed %d temporary file(s) of an interrupted write: %s", len(removed),
                 ", ".join(removed))  # fmt: skip


def _record_start(
    config: TrainConfig,
    topology: Topology,
    recorder: RunRecorder,
    device: torch.device,
    rank_batch: RankBatch,
    class_names: list[str],
) -> None:
    from trainer.training import distributed

    me = {
        "global_rank": topology.global_rank, "local_rank": topology.local_rank,
        "host": topology.host, "pid": os.getpid(), "device": str(device),
        "batch_size": rank_batch.batch_size,
        "oversample_foreground_percent": rank_batch.oversample_share,
        "sigusr1_handler": stop.installed(),
    }  # fmt: skip
    ranks = distributed.gather_objects(me)
    if not topology.is_main:
        return
    assert ranks is not None  # gathered on rank 0
    if not config.validation_only:  # config.json describes the training, not a --val run
        atomic_write_text(
            Path(config.run_dir) / CONFIG_FILE, json.dumps(config.to_dict(), indent=1)
        )
    recorder.event(
        Kind.RUN_STARTED, dataset=config.dataset_name, configuration=config.configuration,
        fold=config.fold, num_epochs=config.num_epochs,
        iterations_per_epoch=config.iterations_per_epoch, world_size=topology.world_size,
        launcher=topology.launcher, host=topology.host, argv=config.argv,
        # What dice_per_class entry i scores: label or region names (trainer.data.labels).
        class_names=class_names,
    )  # fmt: skip
    recorder.event(Kind.TOPOLOGY, ranks=ranks)
    recorder.status(State.STARTING, pids=[r["pid"] for r in ranks])


def _build_trainee(
    config: TrainConfig,
    plans: Plans,
    cplan: ConfigurationPlan,
    device: torch.device,
    weight_ce: float,
) -> Trainee:
    """Network, optimizer and loss, unwrapped (trainee.model is the raw model until _wrap)."""
    import torch

    from trainer.data.cascade import input_channels
    from trainer.network import precision
    from trainer.network.build import build_network
    from trainer.network.label_loss import make_loss
    from trainer.training import distributed
    from trainer.training.loop import Trainee

    torch.manual_seed(config.seed)
    raw_model = build_network(
        cplan.network, input_channels(plans, cplan), plans.num_classes, cplan.ndim,
        recompute_norm=config.recomputes_norm(device.type, cplan.ndim),
    ).to(device)  # fmt: skip
    optimizer = torch.optim.SGD(
        raw_model.parameters(), lr=config.initial_lr, momentum=config.momentum,
        weight_decay=config.weight_decay, nesterov=True,
    )  # fmt: skip
    autocast_dtype = precision.autocast_dtype(config.precision, device.type)
    log.info("precision: %s (--precision %s)", precision.describe(autocast_dtype), config.precision)
    # Loss scaling is needed for fp16 only (bf16 has fp32's exponent range).
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
    # Regions / ignore label: network.label_loss; plain labels: network.loss as before.
    loss_fn = make_loss(
        plans.label_spec, cplan.network.num_stages - 1,
        reduce_fn=distributed.differentiable_all_reduce_sum,
        weight_ce=weight_ce, batch_dice=cplan.batch_dice,
    )  # fmt: skip
    from trainer.allocator import keep_freed_memory

    return Trainee(
        model=raw_model, raw_model=raw_model, optimizer=optimizer, scaler=scaler,
        loss_fn=loss_fn, device=device, autocast_dtype=autocast_dtype,
        num_classes=plans.num_classes, label_spec=plans.label_spec,
        after_first_step=keep_freed_memory if device.type == "cpu" else None,
    )  # fmt: skip


def _wrap(config: TrainConfig, topology: Topology, trainee: Trainee) -> None:
    """DDP (world size > 1) and torch.compile around the restored raw model."""
    import torch

    model: torch.nn.Module = trainee.raw_model
    if topology.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        device = trainee.device
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)
    if config.compile:
        model = cast(torch.nn.Module, torch.compile(model))  # a module in, an OptimizedModule out
    trainee.model = model


Loaded = tuple[dict[str, Any], dict[str, Any], str]  # tensors, metadata, path


def _load_on_main(pick: Callable[[], Loaded | None], topology: Topology) -> Loaded | None:
    """Rank 0 picks and reads the checkpoint and hands it to every rank (other nodes may lack
    the file). None: rank 0 has nothing to resume from. A refusal (CheckpointError,
    IdentityMismatch, BeyondSchedule) fails every rank together."""
    from trainer.training import distributed

    if topology.world_size == 1:
        return pick()
    loaded, error = None, None
    if topology.is_main:
        try:
            loaded = pick()
        except ValueError as exc:
            error = str(exc)
    # One small message first, so every rank fails (or skips) together.
    header = distributed.broadcast_object(
        {"error": error, "metadata": loaded[1] if loaded else None,
         "path": loaded[2] if loaded else None}
    )  # fmt: skip
    if header["error"]:
        raise CheckpointError(f"rank 0 could not load the checkpoint: {header['error']}")
    if header["metadata"] is None:
        return None
    tensors = distributed.broadcast_tensors(loaded[0] if loaded else None)
    return tensors, header["metadata"], header["path"]


def _pick_resume(config: TrainConfig, trainee: Trainee) -> Loaded | None:
    """The newest checkpoint that is intact, of this run and fits the live objects."""
    from trainer.checkpoint import store
    from trainer.checkpoint.fit import check_fits

    def fits(name: str, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
        check_fits(name, tensors, metadata, trainee.raw_model, trainee.optimizer)

    if not config.resume_checkpoint:  # the CLI found none valid (and said so): neither will we
        return None
    found = store.load_resume(Path(config.run_dir), config.identity(), config.num_epochs, fits)
    if found is None:  # the CLI saw one; the torch-side checks refused them all
        log.warning("--c: no usable checkpoint in %s, starting fresh", config.run_dir)
        return None
    return found.tensors, found.info.metadata, str(found.info.path)


def _apply(tensors: dict, metadata: dict, path: str, trainee: Trainee, resume: bool) -> None:
    """checkpoint.apply; the checks before it make a failure here a bug, said in one line."""
    from trainer.checkpoint import store

    try:
        if resume:
            store.apply(
                tensors, metadata, trainee.raw_model, trainee.optimizer, trainee.scaler,
                restore_rng_state=True,
            )  # fmt: skip
        else:
            store.apply(tensors, metadata, trainee.raw_model)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{Path(path).name} does not load: {first_line}") from None


def _restore(
    config: TrainConfig, topology: Topology, trainee: Trainee, recorder: RunRecorder
) -> LoopState:
    """LoopState to start from: fresh, a resumed checkpoint, or the one --val validates.

    Rank 0 chooses (the newest checkpoint that passes every check, as the CLI did) and
    every rank loads the very same tensors and metadata, so weights, optimizer momentum,
    history, EMA and RNG states agree across ranks and nodes.
    """
    from trainer.checkpoint import store
    from trainer.training.loop import History, LoopState

    if config.validation_only:
        path = Path(config.run_dir) / checkpoint_file("best" if config.val_best else "final")
        loaded = _load_on_main(lambda: (*store.load(path), str(path)), topology)
        assert loaded is not None
        tensors, metadata, _ = loaded
        _apply(tensors, metadata, str(path), trainee, resume=False)
        # Progress of a --val run is that of the training it validates.
        config_meta = metadata.get("config")
        trained_epochs = (config_meta if isinstance(config_meta, dict) else {}).get(
            "num_epochs", config.num_epochs
        )
        recorder.status(num_epochs=trained_epochs, epoch=metadata["epoch_next"])
        return LoopState(epoch_next=metadata["epoch_next"])
    if not config.continue_training:
        if config.pretrained_weights:
            _load_pretrained(config, topology, trainee)
        return LoopState()
    loaded = _load_on_main(lambda: _pick_resume(config, trainee), topology)
    if loaded is None:
        return LoopState()
    tensors, metadata, resumed_from = loaded
    _apply(tensors, metadata, resumed_from, trainee, resume=True)
    recorder.status(last_checkpoint=resumed_from)  # true even if it stops before an epoch
    if topology.is_main:
        log.info("continuing from %s at epoch %d", Path(resumed_from).name, metadata["epoch_next"])
    return LoopState(
        epoch_next=metadata["epoch_next"], ema=metadata.get("ema_fg_dice"),
        best_ema=metadata.get("best_ema"), history=History.from_dict(metadata.get("history", {})),
        last_checkpoint=resumed_from, resumed_kind=metadata.get("kind"),
    )  # fmt: skip


def _load_pretrained(config: TrainConfig, topology: Topology, trainee: Trainee) -> None:
    """-pretrained_weights: rank 0 reads the file and picks the tensors whose name and shape
    fit; every rank loads those very tensors (other nodes may lack the file)."""
    from trainer.checkpoint.pretrained import load_matching

    path = str(config.pretrained_weights)

    def pick() -> Loaded:
        tensors, report = load_matching(Path(path), trainee.raw_model)
        return tensors, {"report": report}, path

    loaded = _load_on_main(pick, topology)
    assert loaded is not None
    tensors, metadata, _ = loaded
    trainee.raw_model.load_state_dict(
        {k: v.to(trainee.device) for k, v in tensors.items()}, strict=False
    )
    if topology.is_main:
        log.info("%s", metadata["report"])


def _train(
    config: TrainConfig,
    topology: Topology,
    trainee: Trainee,
    state: LoopState,
    cases: PreprocessedCases,
    streams: dict[str, list[str]],
    cplan: ConfigurationPlan,
    rank_batch: RankBatch,
    recorder: RunRecorder,
    checkpointer: Checkpointer,
) -> bool:
    """The epochs, with both loaders closed whatever happens. False = stopped by SIGUSR1."""
    from trainer.data.cascade import CascadeBatches, CascadeCases
    from trainer.data.labels import location_rule
    from trainer.data.loader import PatchLoader
    from trainer.training.loop import run_epochs

    spec = trainee.label_spec
    with contextlib.ExitStack() as exits:

        def make_batches(stream: str, start_iteration: int) -> Any:
            # The stream is a pure function of (seed, rank, stream, iteration): starting at
            # epoch * iterations continues exactly where an uninterrupted run would be.
            loader = PatchLoader(
                cases, streams[stream], tuple(cplan.patch_size), rank_batch.batch_size,
                rank_batch.oversample_share, config.seed, topology.global_rank, trainee.device,
                augment=stream == "train", start_iteration=start_iteration,
                num_workers=config.num_workers, stream=stream, augment_on=config.augment_on,
                mask_channels=tuple(cplan.use_mask_for_norm), rule=location_rule(spec),
            )  # fmt: skip
            batches = iter(exits.enter_context(loader))
            if isinstance(cases, CascadeCases):  # seg + K * previous -> seg, one-hot input
                return CascadeBatches(batches, cases.factor, cases.labels)
            return batches

        return run_epochs(
            config, trainee, state, make_batches, recorder, checkpointer, topology.world_size
        )


def _final_validation(
    config: TrainConfig,
    topology: Topology,
    trainee: Trainee,
    cases: PreprocessedCases,
    val_ids: list[str],
    plans: Plans,
    cplan: ConfigurationPlan,
    recorder: RunRecorder,
) -> None:
    """Whole validation cases, split val_ids[rank::W], written and scored in the raw
    geometry by rank 0 (trainer.training.final_validation); `validation_finished` from its
    summary."""
    from trainer.training.final_validation import evaluation_model, progress_line, validate

    recorder.status(State.RUNNING, message="final validation")
    model = evaluation_model(plans, cplan, trainee.raw_model, trainee.device)
    recorder.event(Kind.VALIDATION_STARTED, num_cases=len(val_ids))

    began = time.perf_counter()

    def progress(num_done: int, num_cases: int) -> None:  # rank 0, after each round of cases
        elapsed_s = time.perf_counter() - began
        log.info(progress_line(num_done, num_cases, elapsed_s))
        recorder.event(Kind.VALIDATION_CASE, index=num_done, num_cases=num_cases,
                       seconds_per_case=elapsed_s / max(num_done, 1))  # fmt: skip

    summary = validate(
        config, topology, model, cases, val_ids, plans, cplan, trainee.device,
        trainee.autocast_dtype, stop_notice(), progress,
    )  # fmt: skip
    del model
    if summary is None:
        return
    foreground = list(summary["mean"])
    mean_fg_dice = summary["foreground_mean"]["Dice"]
    recorder.event(
        Kind.VALIDATION_FINISHED, mean_fg_dice=mean_fg_dice,
        dice_per_class=[summary["mean"][label]["Dice"] for label in foreground],
        class_names=plans.label_spec.class_names(),
        num_cases=len(summary["metric_per_case"]),
    )  # fmt: skip
    recorder.status(message=None)
    space = "raw geometry" if config.raw_dataset_dir else "preprocessed space"
    log.info("final validation (%s, mirroring %s): mean foreground Dice %s over %d cases",
             space, mirroring.describe(config.val_mirror, config.val_mirror_axes),
             "undefined" if mean_fg_dice is None else f"{mean_fg_dice:.4f}",
             len(summary["metric_per_case"]))  # fmt: skip


def stop_notice() -> Callable[[], None]:
    """Called after each validated case: says once that a SIGUSR1 waits for the final
    validation to finish (there is nothing to resume after it)."""
    told: list[bool] = []

    def on_case() -> None:
        if stop.requested() and not told:
            told.append(True)
            log.warning("SIGUSR1 received during the final validation: finishing it first")

    return on_case
