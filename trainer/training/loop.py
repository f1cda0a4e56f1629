"""The epoch loop: train iterations, validation iterations, metrics, checkpoints, stop.

One code path for single-process, `-num_gpus` spawn and torchrun: every collective goes
through trainer.training.distributed (no-ops at world size 1). Only global rank 0 writes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer import stop
from trainer.checkpoint import store as checkpoint
from trainer.data.labels import is_plain
from trainer.network import precision
from trainer.network.label_loss import validation_counts
from trainer.schema.events import Kind
from trainer.schema.status import State
from trainer.schema.tree import checkpoint_file
from trainer.training import distributed, running_loss
from trainer.training.config import TrainConfig
from trainer.training.events import RunRecorder, finite_or_none

log = logging.getLogger("trainer")

EMA_OLD_WEIGHT = 0.9


def poly_lr(initial_lr: float, epoch: int, num_epochs: int, exponent: float = 0.9) -> float:
    return initial_lr * (1 - epoch / num_epochs) ** exponent


@dataclass
class History:
    """Per-epoch metrics; stored in checkpoints so curves continue after `--c`."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    dice_per_class: list[list[float | None]] = field(default_factory=list)
    mean_fg_dice: list[float | None] = field(default_factory=list)
    ema_fg_dice: list[float | None] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    epoch_time_s: list[float] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        return cls(**{k: list(data.get(k, [])) for k in cls.__dataclass_fields__})


@dataclass
class LoopState:
    epoch_next: int = 0
    ema: float | None = None
    best_ema: float | None = None
    history: History = field(default_factory=History)
    last_checkpoint: str | None = None
    resumed_kind: str | None = None  # "latest" | "best" | "final" when started from one


@dataclass
class Trainee:
    """The live objects the loop drives (built by trainer.training.worker)."""

    model: torch.nn.Module  # what the loop calls (maybe DDP- and/or compile-wrapped)
    raw_model: torch.nn.Module  # what checkpoints hold
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: torch.nn.Module
    device: torch.device
    autocast_dtype: torch.dtype | None
    num_classes: int
    label_spec: Any = None  # data.labels.LabelSpec: regions / ignore label change the counts
    after_first_step: Callable[[], Any] | None = None  # allocator.keep_freed_memory on CPU
    step_hook: Callable[[int, torch.Tensor], Any] | None = None  # running loss (rank 0)
    stop_notice: StopNotice | None = None  # says "stop heard" at the first step after SIGUSR1


class StopNotice:
    """Records a SIGUSR1 at the next training step, outside the signal handler (which only
    sets a flag): the console line, status `stopping` and a `stop_heard` event, once. The stop
    itself still happens at the epoch's end, agreed across ranks (record_stop)."""

    def __init__(self, recorder: RunRecorder) -> None:
        self.recorder = recorder
        self.epoch = 0
        self.noted = False

    def check(self) -> None:
        if self.noted or not stop.requested():
            return
        self.noted = True
        log.info("SIGUSR1 received: stopping at the end of epoch %d", self.epoch + 1)
        self.recorder.status(State.STOPPING)
        self.recorder.event(Kind.STOP_HEARD, epoch=self.epoch)


class Checkpointer:
    """Writes checkpoints (rank 0, unless disabled) and records checkpoint_saved."""

    def __init__(self, config: TrainConfig, trainee: Trainee, recorder: RunRecorder, is_main: bool):
        self.config = config
        self.trainee = trainee
        self.recorder = recorder
        self.enabled = is_main and not config.disable_checkpointing
        self.run_dir = Path(config.run_dir)

    def save(self, kind: str, state: LoopState) -> None:
        if not self.enabled:
            return
        path = self.run_dir / checkpoint_file(kind)
        metadata = {
            "kind": kind,
            "epoch_next": state.epoch_next,
            "ema_fg_dice": state.ema,
            "best_ema": state.best_ema,
            "history": vars(state.history),
            "config": self.config.to_dict(),
            "identity": self.config.identity(),
            "configuration": self.config.configuration,
        }
        t = self.trainee
        write_time_s = checkpoint.save(path, t.raw_model, t.optimizer, t.scaler, metadata)
        state.last_checkpoint = str(path)
        self.recorder.event(
            Kind.CHECKPOINT_SAVED,
            checkpoint=kind,
            path=str(path),
            epoch=state.epoch_next - 1,
            write_time_s=round(write_time_s, 4),
        )
        self.recorder.status(last_checkpoint=str(path))
        log.info("saved %s (%d epochs done) in %.3f s", path.name, state.epoch_next, write_time_s)


def _autocast(trainee: Trainee):
    return precision.autocast(trainee.device.type, trainee.autocast_dtype)


def train_iterations(
    trainee: Trainee, batches: Iterator[Any], num_iterations: int, grad_clip: float
) -> torch.Tensor:
    """Summed training loss over num_iterations steps (a tensor: one sync per epoch)."""
    trainee.model.train()
    total = torch.zeros((), device=trainee.device)
    params = [p for p in trainee.model.parameters() if p.requires_grad]
    for step in range(num_iterations):
        batch = next(batches)
        # Preprocessed segmentations may mark "outside the mask" as -1: background here.
        target = batch.target.clamp_min(0)
        trainee.optimizer.zero_grad(set_to_none=True)
        with _autocast(trainee):
            outputs = trainee.model(batch.data)
            loss = trainee.loss_fn(outputs, target)
        trainee.scaler.scale(loss).backward()
        trainee.scaler.unscale_(trainee.optimizer)
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        trainee.scaler.step(trainee.optimizer)
        trainee.scaler.update()
        total += loss.detach()
        if trainee.step_hook is not None:  # reads `total` only a few times per epoch
            trainee.step_hook(step + 1, total)
        if trainee.after_first_step is not None:
            trainee.after_first_step()
            trainee.after_first_step = None
        if trainee.stop_notice is not None:
            trainee.stop_notice.check()
    return total


def num_scored(trainee: Trainee) -> int:
    """Classes (or regions) the pseudo-Dice scores."""
    if trainee.label_spec is None:
        return trainee.num_classes - 1
    return len(trainee.label_spec.foreground_keys)


@torch.no_grad()
def validation_iterations(
    trainee: Trainee, batches: Iterator[Any], num_iterations: int
) -> torch.Tensor:
    """[summed val loss, tp(K-1), fp(K-1), fn(K-1)] on the argmax of the top output."""
    trainee.model.eval()
    k = num_scored(trainee)
    plain = trainee.label_spec is None or is_plain(trainee.label_spec)
    stats = torch.zeros(1 + 3 * k, device=trainee.device, dtype=torch.float64)
    for _ in range(num_iterations):
        batch = next(batches)
        target = batch.target.clamp_min(0)
        with _autocast(trainee):
            outputs = trainee.model(batch.data)
            loss = trainee.loss_fn(outputs, target)
        top = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
        stats[0] += loss.detach().double()
        if not plain:  # regions (sigmoid > 0.5) or the ignore label left out
            counts = validation_counts(top, target, trainee.label_spec)
            stats[1:] += torch.cat(counts).double()
            continue
        pred = top.argmax(1)
        labels = target[:, 0].long()
        for c in range(1, k + 1):
            p, g = pred == c, labels == c
            stats[c] += (p & g).sum()
            stats[k + c] += (p & ~g).sum()
            stats[2 * k + c] += (~p & g).sum()
    return stats


def pseudo_dice(tp: list[float], fp: list[float], fn: list[float]) -> list[float]:
    return [
        2 * a / (2 * a + b + c) if (2 * a + b + c) > 0 else math.nan
        for a, b, c in zip(tp, fp, fn, strict=True)
    ]


def nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def record_stop(
    state: LoopState,
    epoch: int,
    recorder: RunRecorder,
    checkpointer: Checkpointer,
    write_latest: bool,
) -> None:
    """Agreed stop at an epoch boundary: latest checkpoint, events, status (all ranks call)."""
    ranks = distributed.gather_objects(stop.requested())
    signalled = [rank for rank, flag in enumerate(ranks or []) if flag]
    recorder.status(State.STOPPING)
    recorder.event(Kind.STOP_REQUESTED, epoch=epoch, ranks=signalled)
    if ranks is not None:  # rank 0 knows who was signalled
        # Epochs are shown 1-based (epoch 3/300 = the third, done): as nnui's table.
        log.info("SIGUSR1 received (ranks %s): stopping after epoch %d", signalled, epoch + 1)
    if write_latest:
        checkpointer.save("latest", state)
    recorder.event(Kind.STOPPED, epoch=epoch, reason="SIGUSR1")
    recorder.status(State.STOPPED, epoch=state.epoch_next)
    if checkpointer.config.disable_checkpointing:
        log.info("stopped (--disable_checkpointing: no checkpoint to continue from)")
    else:
        log.info("stopped; continue with --c")


@dataclass(frozen=True)
class EpochMetrics:
    """One epoch's numbers, summed over ranks, before they enter the history and events."""

    lr: float
    train_loss: float
    val_loss: float
    dice: list[float]
    mean_dice: float
    train_time_s: float
    data_wait_s: float


def _set_lr(trainee: Trainee, lr: float) -> None:
    for group in trainee.optimizer.param_groups:
        group["lr"] = lr


def _run_epoch(
    config: TrainConfig,
    trainee: Trainee,
    epoch: int,
    train_batches: Iterator[Any],
    val_batches: Iterator[Any],
    started: float,
    world_size: int,
) -> EpochMetrics:
    """One epoch's steps and validation; losses and Dice all-reduced in one collective."""
    waited_s = getattr(train_batches, "wait_s", 0.0)  # a PatchLoader counts its waits
    lr = poly_lr(config.initial_lr, epoch, config.num_epochs)
    _set_lr(trainee, lr)
    train_sum = train_iterations(
        trainee, train_batches, config.iterations_per_epoch, config.grad_clip_norm
    )
    train_time_s = time.perf_counter() - started
    data_wait_s = getattr(train_batches, "wait_s", 0.0) - waited_s
    val_stats = validation_iterations(trainee, val_batches, config.val_iterations)
    totals = (
        distributed.all_reduce_sum(torch.cat((train_sum.double().reshape(1), val_stats)))
        .cpu()
        .tolist()
    )
    k = num_scored(trainee)
    dice = pseudo_dice(totals[2 : 2 + k], totals[2 + k : 2 + 2 * k], totals[2 + 2 * k :])
    return EpochMetrics(
        lr=lr,
        train_loss=totals[0] / (config.iterations_per_epoch * world_size),
        val_loss=totals[1] / (config.val_iterations * world_size),
        dice=dice,
        mean_dice=nanmean(dice),
        train_time_s=train_time_s,
        data_wait_s=data_wait_s,
    )


def _update_ema(state: LoopState, mean_dice: float) -> None:
    # An epoch whose Dice is undefined (no foreground anywhere) leaves the EMA as it was.
    if not math.isnan(mean_dice):
        state.ema = (
            mean_dice
            if state.ema is None
            else EMA_OLD_WEIGHT * state.ema + (1 - EMA_OLD_WEIGHT) * mean_dice
        )


def _append_history(state: LoopState, m: EpochMetrics, epoch_time_s: float) -> None:
    h = state.history
    h.train_loss.append(m.train_loss)
    h.val_loss.append(m.val_loss)
    h.dice_per_class.append([finite_or_none(d) for d in m.dice])
    h.mean_fg_dice.append(finite_or_none(m.mean_dice))
    h.ema_fg_dice.append(state.ema)
    h.lr.append(m.lr)
    h.epoch_time_s.append(epoch_time_s)


def _report_epoch(
    config: TrainConfig,
    state: LoopState,
    epoch: int,
    m: EpochMetrics,
    epoch_time_s: float,
    recorder: RunRecorder,
) -> None:
    """epoch_ended event, status and log line (history already holds this epoch)."""
    h = state.history
    recorder.event(
        Kind.EPOCH_ENDED,
        epoch=epoch,
        train_loss=m.train_loss,
        val_loss=m.val_loss,
        dice_per_class=h.dice_per_class[-1],
        mean_fg_dice=h.mean_fg_dice[-1],
        ema_fg_dice=state.ema,
        lr=m.lr,
        epoch_time_s=round(epoch_time_s, 4),
        iterations_per_s=round(config.iterations_per_epoch / max(m.train_time_s, 1e-9), 4),
        # Of the training time, how long the step waited for data (0 = loading hidden).
        data_wait_s=round(m.data_wait_s, 4),
        # The same as a share of the training steps' time: what the board shows and alerts on.
        data_wait_share=round(min(1.0, m.data_wait_s / max(m.train_time_s, 1e-9)), 4),
        # Losses are written as null when not finite; this flag keeps the alarm explicit.
        nan_loss=not (math.isfinite(m.train_loss) and math.isfinite(m.val_loss)),
    )
    recorder.status(epoch=state.epoch_next)
    log.info(
        "epoch %d/%d lr %.6f train_loss %.4f val_loss %.4f pseudo_dice %s ema %.4f "
        "epoch_time %.2f s",
        epoch + 1,  # 1-based, so the line of the third epoch says 3/N as nnui's table does
        config.num_epochs,
        m.lr,
        m.train_loss,
        m.val_loss,
        [round(d, 4) for d in m.dice],
        state.ema if state.ema is not None else math.nan,
        epoch_time_s,
    )


def _save_if_best(state: LoopState, checkpointer: Checkpointer) -> None:
    if state.ema is not None and (state.best_ema is None or state.ema > state.best_ema):
        state.best_ema = state.ema
        log.info("new best EMA pseudo Dice %.4f", state.ema)
        checkpointer.save("best", state)


def run_epochs(
    config: TrainConfig,
    trainee: Trainee,
    state: LoopState,
    make_batches: Callable[[str, int], Iterator[Any]],
    recorder: RunRecorder,
    checkpointer: Checkpointer,
    world_size: int,
) -> bool:
    """Train from state.epoch_next to num_epochs. Returns False if stopped by SIGUSR1."""
    train_batches = make_batches("train", state.epoch_next * config.iterations_per_epoch)
    val_batches = make_batches("val", state.epoch_next * config.val_iterations)
    recorder.status(State.RUNNING, epoch=state.epoch_next)
    trainee.stop_notice = StopNotice(recorder)
    for epoch in range(state.epoch_next, config.num_epochs):
        stop.install()  # again each epoch: torch.compile's start-up may replace it
        trainee.stop_notice.epoch = epoch
        started = time.perf_counter()
        trainee.step_hook = running_loss.epoch_hook(recorder, epoch, config.iterations_per_epoch)
        metrics = _run_epoch(
            config, trainee, epoch, train_batches, val_batches, started, world_size
        )
        _update_ema(state, metrics.mean_dice)
        epoch_time_s = time.perf_counter() - started
        _append_history(state, metrics, epoch_time_s)
        state.epoch_next = epoch + 1
        _report_epoch(config, state, epoch, metrics, epoch_time_s, recorder)
        _save_if_best(state, checkpointer)
        if distributed.stop_agreed(stop.requested(), trainee.device):
            record_stop(state, epoch, recorder, checkpointer, write_latest=True)
            return False
        if state.epoch_next % config.save_every == 0 and state.epoch_next < config.num_epochs:
            checkpointer.save("latest", state)
    return True
