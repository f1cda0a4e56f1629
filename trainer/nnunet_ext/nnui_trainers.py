"""nnU-Net trainer classes with nnui's stop protocol and event contract (docs/contract.md).

nnU-Net 2.8 finds trainer classes in the folders named by `nnUNet_extTrainer`; this module
is the only one in such a folder (trainer/nnunet_ext/). Everything is added through
nnU-Net's public hooks; none of nnU-Net's files is changed and none of its outputs differs:

- `-tr nnUNetTrainer_nnui` is nnU-Net's own trainer plus nnui's hooks; `-tr <Name>_nnui`
  wraps any other trainer nnU-Net can find by name (`nnUNetTrainerNoMirroring_nnui`,
  ResEnc or Primus users' trainers). A wrapped class presents itself to nnU-Net under its
  base's name, so it trains in the base's fold folder and its checkpoints name the base:
  `--c` continues a stock run and a stock `nnUNetv2_predict -tr <Name>` uses the result.
- SIGUSR1 only sets a flag (trainer.stop), installed at import and at every epoch start.
  At each epoch end the flag is all-reduced (MAX) across ranks; if set, rank 0 writes
  `checkpoint_latest.pth`, every rank shuts its data workers down, leaves the process group
  and exits 0, so `nnUNetv2_train ... --c` continues.
- rank 0 writes nnui's `events.jsonl` and `status.json` (schema v1) in the fold folder.
- the schedule comes from NNUI_EPOCHS, NNUI_ITERATIONS_PER_EPOCH, NNUI_VAL_ITERATIONS and
  NNUI_SAVE_EVERY (nnU-Net builds trainers with a fixed signature, so the environment is
  the one channel; `python -m trainer.nnunet_engine` sets them from nnui's flags).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import traceback
from os.path import join
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

from trainer import stop
from trainer.schema.events import Kind
from trainer.schema.exits import EXIT_OK
from trainer.schema.nnunet import NNUNET_WRAP_SUFFIX, nnunet_classes
from trainer.schema.status import State
from trainer.training.events import RunRecorder

stop.install()

WRAP_SUFFIX = NNUNET_WRAP_SUFFIX
SCHEDULE_ENV = {
    "num_epochs": "NNUI_EPOCHS",
    "num_iterations_per_epoch": "NNUI_ITERATIONS_PER_EPOCH",
    "num_val_iterations_per_epoch": "NNUI_VAL_ITERATIONS",
    "save_every": "NNUI_SAVE_EVERY",
}


class GracefulStop(BaseException):
    """Raised out of the epoch loop once every rank agreed to stop (never an error)."""


def agree_on_stop(flag: bool, device: torch.device) -> bool:
    """True on every rank when any rank was asked to stop (all_reduce MAX; local otherwise)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=on)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _finite(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


if TYPE_CHECKING:  # the hooks are mixed into an nnU-Net trainer: they use its attributes
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer as _Mixin
else:
    _Mixin = object


class NnuiHooks(_Mixin):
    """Mixed in before an nnU-Net trainer class (see wrap())."""

    def __init__(
        self,
        plans: dict,
        configuration: str,
        fold: int,
        dataset_json: dict,
        device: torch.device = torch.device("cuda"),  # noqa: B008 - nnU-Net's signature
    ):
        super().__init__(plans, configuration, fold, dataset_json, device)
        for attribute, variable in SCHEDULE_ENV.items():
            if os.environ.get(variable):
                setattr(self, attribute, int(os.environ[variable]))
        self._nnui_recorder: RunRecorder | None = None
        self._nnui_configuration = configuration
        self._nnui_fold = str(fold)
        self._nnui_epoch_started = time.perf_counter()

    # ---- records (rank 0) -----------------------------------------------------------------

    def _nnui_record(self) -> RunRecorder:
        if self._nnui_recorder is None:
            self._nnui_recorder = RunRecorder(
                self.output_folder, enabled=self.local_rank == 0, num_epochs=self.num_epochs
            )
        return self._nnui_recorder

    def _nnui_world_size(self) -> int:
        return dist.get_world_size() if self.is_ddp else 1

    def _nnui_topology(self) -> list[dict]:
        """Every rank's pid and device, gathered as integers (no pickle on the wire)."""
        index = self.device.index if self.device.type == "cuda" else -1
        mine = [os.getpid(), int(os.environ.get("LOCAL_RANK", str(self.local_rank))), index]
        mine += [int(self.batch_size), int(stop.installed())]
        rows = [mine]
        if self.is_ddp:
            on = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            local = torch.tensor(mine, dtype=torch.int64, device=on)
            gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
            rows = [t.tolist() for t in gathered]
        host = socket.gethostname()
        return [
            {
                "global_rank": rank,
                "local_rank": local_rank,
                "host": host,
                "pid": pid,
                "device": f"cuda:{device}" if device >= 0 else self.device.type,
                "batch_size": batch,
                "oversample_foreground_percent": float(self.oversample_foreground_percent),
                "sigusr1_handler": bool(handler),
            }
            for rank, (pid, local_rank, device, batch, handler) in enumerate(rows)
        ]

    def _nnui_class_names(self) -> list[str]:
        """dataset.json's names of the pseudo-Dice entries, for the board's curves."""
        return [name for name, _ in trainer_classes(self)]

    # ---- nnU-Net's hooks --------------------------------------------------------------------

    def on_train_start(self):
        super().on_train_start()
        ranks = self._nnui_topology()  # a collective: every rank takes part
        recorder = self._nnui_record()
        recorder.event(
            Kind.RUN_STARTED,
            dataset=self.plans_manager.dataset_name,
            configuration=self._nnui_configuration,
            fold=self._nnui_fold,
            num_epochs=self.num_epochs,
            iterations_per_epoch=self.num_iterations_per_epoch,
            world_size=self._nnui_world_size(),
            launcher="spawn" if self.is_ddp else "single",
            engine="nnunet",
            trainer=type(self).__name__,
            start_epoch=self.current_epoch,
            host=socket.gethostname(),
            argv=list(sys.argv),
            class_names=self._nnui_class_names(),
        )
        recorder.event(Kind.TOPOLOGY, ranks=ranks)
        recorder.status(State.RUNNING, epoch=self.current_epoch, pids=[r["pid"] for r in ranks])

    def on_epoch_start(self):
        stop.install()  # again: a library may have replaced it since
        self._nnui_epoch_started = time.perf_counter()
        super().on_epoch_start()

    def on_epoch_end(self):
        epoch = self.current_epoch
        super().on_epoch_end()  # logs, best/periodic checkpoints, then current_epoch += 1
        self._nnui_epoch_event(epoch)
        if agree_on_stop(stop.requested(), self.device):
            self._nnui_record().event(Kind.STOP_REQUESTED, epoch=epoch)
            self.current_epoch -= 1  # as nnU-Net's on_train_end: store the next epoch
            self.save_checkpoint(join(self.output_folder, "checkpoint_latest.pth"))
            self.current_epoch += 1
            raise GracefulStop

    def _nnui_epoch_event(self, epoch: int) -> None:
        value = self.logger.get_value
        train_loss, val_loss = _finite(value("train_losses", -1)), _finite(value("val_losses", -1))
        seconds = time.perf_counter() - self._nnui_epoch_started
        iterations = self.num_iterations_per_epoch + self.num_val_iterations_per_epoch
        recorder = self._nnui_record()
        recorder.event(
            Kind.EPOCH_ENDED,
            epoch=epoch,
            train_loss=train_loss,
            val_loss=val_loss,
            dice_per_class=[_finite(d) for d in value("dice_per_class_or_region", -1)],
            mean_fg_dice=_finite(value("mean_fg_dice", -1)),
            ema_fg_dice=_finite(value("ema_fg_dice", -1)),
            lr=_finite(value("lrs", -1)),
            epoch_time_s=seconds,
            iterations_per_s=iterations / seconds if seconds > 0 else None,
            data_wait_s=None,  # nnU-Net's loader does not say
            nan_loss=train_loss is None or val_loss is None,
        )
        recorder.status(epoch=epoch + 1)

    def save_checkpoint(self, filename: str) -> None:
        started = time.perf_counter()
        super().save_checkpoint(filename)
        if self.local_rank != 0 or self.disable_checkpointing:
            return
        kind = os.path.basename(filename).removeprefix("checkpoint_").removesuffix(".pth")
        self._nnui_record().event(
            Kind.CHECKPOINT_SAVED,
            checkpoint=kind,
            path=filename,
            epoch=self.current_epoch,
            write_time_s=time.perf_counter() - started,
        )
        self._nnui_record().status(last_checkpoint=kind)

    def run_training(self):
        try:
            super().run_training()
        except GracefulStop:
            self._nnui_leave()
        except BaseException as error:
            self._nnui_record().failed(f"{type(error).__name__}: {error}", traceback.format_exc())
            raise

    def perform_actual_validation(self, save_probabilities: bool = False):
        recorder = self._nnui_record()
        recorder.event(Kind.VALIDATION_STARTED, epoch=self.current_epoch - 1)
        try:
            super().perform_actual_validation(save_probabilities)
        except BaseException as error:
            recorder.failed(f"{type(error).__name__}: {error}", traceback.format_exc())
            raise
        summary = _read_summary(
            join(self.output_folder, "validation", "summary.json"), trainer_classes(self)
        )
        if summary is not None:
            recorder.event(Kind.VALIDATION_FINISHED, **summary)
        recorder.event(Kind.FINISHED, epoch=self.current_epoch - 1)
        recorder.status(State.FINISHED, epoch=self.current_epoch)
        recorder.close()

    def _nnui_leave(self) -> None:
        """After an agreed stop: records, data workers down, group left, exit 0 on every rank."""
        recorder = self._nnui_record()
        recorder.event(Kind.STOPPED, epoch=self.current_epoch - 1)
        recorder.status(State.STOPPED, epoch=self.current_epoch, message="stopped by SIGUSR1")
        recorder.close()
        for loader in (self.dataloader_train, self.dataloader_val):
            finish = getattr(loader, "_finish", None)
            if finish is not None:
                finish()
        if self.is_ddp:
            dist.barrier()
            dist.destroy_process_group()
        self.print_to_log_file("Stopped gracefully (SIGUSR1): checkpoint_latest.pth written.")
        sys.stdout.flush()
        sys.exit(EXIT_OK)  # skips nnU-Net's final validation; a spawned rank exits 0 too


def trainer_classes(trainer) -> list[tuple[str, str]]:
    """schema.nnunet_classes of an nnU-Net trainer's dataset.json; [] unreadable."""
    try:
        return nnunet_classes(trainer.dataset_json["labels"])
    except (AttributeError, KeyError, TypeError):
        return []


def _read_summary(path: str, named: list[tuple[str, str]]) -> dict | None:
    """validation_finished's fields from nnU-Net's summary.json (None when unreadable), in
    the order of `named` (the file sorts its keys as text: "10" before "2"), with names."""
    try:
        with open(path) as handle:
            summary = json.load(handle)
        per_class = summary["mean"]
        fields: dict = {
            "mean_fg_dice": _finite(summary["foreground_mean"]["Dice"]),
            "num_cases": len(summary.get("metric_per_case", [])),
        }
        if named and all(key in per_class for _, key in named):
            fields["dice_per_class"] = [_finite(per_class[key].get("Dice")) for _, key in named]
            fields["class_names"] = [name for name, _ in named]
        else:  # names unknown: the file's entries as they come
            fields["dice_per_class"] = [_finite(v.get("Dice")) for v in per_class.values()]
        return fields
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


_wrapped: dict[str, type] = {}


def wrap(base: type) -> type:
    """`base` with nnui's hooks; nnU-Net sees the base's name (fold folder, checkpoints)."""
    if base.__name__ not in _wrapped:
        cls = type(base.__name__, (NnuiHooks, base), {"__module__": __name__})
        cls.__qualname__ = base.__name__
        _wrapped[base.__name__] = cls
    return _wrapped[base.__name__]


nnUNetTrainer_nnui = wrap(nnUNetTrainer)


def __getattr__(name: str) -> type:
    """`<AnyTrainer>_nnui`: nnU-Net looks classes up by name with hasattr(), which lands here."""
    if not name.endswith(WRAP_SUFFIX) or name.startswith("_"):
        raise AttributeError(name)
    from nnunetv2.utilities.find_objects import recursive_find_trainer_class_by_name

    try:
        base = recursive_find_trainer_class_by_name(name.removesuffix(WRAP_SUFFIX))
    except RuntimeError as error:  # nnU-Net's "could not find" for the base name
        raise AttributeError(name) from error
    return wrap(base)
