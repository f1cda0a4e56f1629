"""A short-schedule nnU-Net v2 trainer for side-by-side benchmarks (runs in nnU-Net's venv).

bench/compare_nnunet.py copies this file to the top level of nnU-Net's
`nnunetv2/training/nnUNetTrainer/` package as `nnUNetTrainer_nnuiBench.py`: nnU-Net finds a
`-tr` class by importing the modules of that package, and a top-level module is found
before the `primus/` sub-package, whose import needs a torchvision that does not load with
the CPU torch (see notes/nnunet-baseline.md).

It changes no work done per iteration. It only
- sets the schedule from the environment (nnUNetv2_train builds the trainer with a fixed
  signature, so the environment is the one channel): NNUI_BENCH_EPOCHS,
  NNUI_BENCH_ITERATIONS, NNUI_BENCH_VAL_ITERATIONS;
- writes wall-clock stamps to `bench_timing.jsonl` in the fold folder (first training
  step, start and end of every training and validation phase, augmentation worker pids),
  so training time is measured without validation and start-up;
- skips the final sliding-window validation (not part of the compared training work),
  unless NNUI_BENCH_FINAL_VALIDATION=1 (bench/accuracy.py, which judges by its Dice);
  NNUI_BENCH_VAL_DISABLE_TTA=1 runs that validation without mirroring.
"""

from __future__ import annotations

import json
import os
import time

import torch
from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

TIMING_FILE = "bench_timing.jsonl"


class nnUNetTrainer_nnuiBench(nnUNetTrainer):  # nnU-Net's -tr naming
    # nnU-Net records the constructor's arguments by inspecting its signature: keep it explicit.
    def __init__(
        self,
        plans: dict,
        configuration: str,
        fold: int,
        dataset_json: dict,
        device: torch.device = torch.device("cuda"),  # noqa: B008 - nnU-Net's default
    ):
        super().__init__(plans, configuration, fold, dataset_json, device)
        self.num_epochs = int(os.environ.get("NNUI_BENCH_EPOCHS", "5"))
        self.num_iterations_per_epoch = int(os.environ.get("NNUI_BENCH_ITERATIONS", "20"))
        self.num_val_iterations_per_epoch = int(os.environ.get("NNUI_BENCH_VAL_ITERATIONS", "2"))
        self._bench_first_step_seen = False

    def _bench_stamp(self, event: str, **fields) -> None:
        os.makedirs(self.output_folder, exist_ok=True)
        record = {"t": time.time(), "event": event, "epoch": self.current_epoch, **fields}
        with open(os.path.join(self.output_folder, TIMING_FILE), "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def get_dataloaders(self):
        train, val = super().get_dataloaders()
        self._bench_stamp(
            "dataloaders",
            train_worker_pids=[p.pid for p in getattr(train, "_processes", [])],
            val_worker_pids=[p.pid for p in getattr(val, "_processes", [])],
            batch_size=self.batch_size,
            patch_size=list(self.configuration_manager.patch_size),
        )
        return train, val

    def on_train_epoch_start(self):
        super().on_train_epoch_start()
        self._bench_stamp("train_start")

    def train_step(self, batch: dict) -> dict:
        if not self._bench_first_step_seen:
            self._bench_first_step_seen = True
            self._bench_stamp("first_step")
        return super().train_step(batch)

    def on_train_epoch_end(self, train_outputs):
        self._bench_stamp("train_end")
        super().on_train_epoch_end(train_outputs)

    def on_validation_epoch_end(self, val_outputs):
        self._bench_stamp("val_end")
        super().on_validation_epoch_end(val_outputs)

    def on_train_end(self):
        self._bench_stamp("training_done")
        super().on_train_end()

    def perform_actual_validation(self, save_probabilities: bool = False):
        if os.environ.get("NNUI_BENCH_FINAL_VALIDATION") == "1":
            self._bench_stamp("final_validation_start")
            if os.environ.get("NNUI_BENCH_VAL_DISABLE_TTA") == "1":
                # nnU-Net's final validation always mirrors; no allowed axes = no mirroring
                # (as nnui-train --val_disable_tta), for CPU budgets where 4x costs too much.
                self.inference_allowed_mirroring_axes = None
            super().perform_actual_validation(save_probabilities)
            self._bench_stamp("final_validation_end")
            return
        self.print_to_log_file("bench trainer: final validation skipped")


def data_cost_main() -> int:
    """CPU-s per augmented training sample of nnU-Net's data side, measured inline.

    python -m nnunetv2.training.nnUNetTrainer.nnUNetTrainer_nnuiBench DATASET CONFIG FOLD [N]
    With nnUNet_n_proc_DA=0 its loader and transforms run in this process (a
    SingleThreadedAugmenter), so `time.process_time()` counts all of their work.
    """
    import sys

    from nnunetv2.run.run_training import get_trainer_from_args

    dataset, configuration, fold = sys.argv[1], sys.argv[2], int(sys.argv[3])
    num_batches = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    os.environ["nnUNet_n_proc_DA"] = "0"  # noqa: SIM112 - nnU-Net's own name
    if os.environ.get("NNUI_BENCH_THREADS"):  # else torch's default, as its DA workers run
        torch.set_num_threads(int(os.environ["NNUI_BENCH_THREADS"]))
    trainer = get_trainer_from_args(
        dataset, configuration, fold, "nnUNetTrainer_nnuiBench", device=torch.device("cpu")
    )
    trainer.initialize()
    train, _ = trainer.get_dataloaders()  # takes one warm-up batch of each stream
    next(train)
    started = time.process_time()
    for _ in range(num_batches):
        next(train)
    cpu_s = time.process_time() - started
    per_sample = cpu_s / (num_batches * trainer.batch_size)
    print(
        json.dumps(
            {
                "data_cpu_s_per_sample": per_sample,
                "batches": num_batches,
                "batch_size": trainer.batch_size,
                "torch_threads": torch.get_num_threads(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(data_cost_main())
