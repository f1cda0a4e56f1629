"""The resolved training configuration: built and validated once in the CLI process.

It travels to every rank as the worker payload (a plain JSON-able dict), is written to
`config.json` and stored in every checkpoint's metadata.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trainer import legacy
from trainer.network import precision
from trainer.schema.tree import DEFAULT_PLANS, DEFAULT_TRAINER, FOLDS

DEVICE_TYPES = ("cuda", "cpu", "mps")
RECOMPUTE_CHOICES = ("auto", "on", "off")
# Where training augmentation runs: the training device, or CPU loader threads (nnU-Net's
# way: the GPU only trains, the CPU cores augment).
AUGMENT_CHOICES = ("device", "cpu")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a rank needs to train one fold; paths are absolute strings."""

    dataset_name: str
    configuration: str
    fold: str
    preprocessed_dataset_dir: str
    run_dir: str
    plans_identity: str
    trainer: str = DEFAULT_TRAINER
    plans_name: str = DEFAULT_PLANS
    num_epochs: int = 1000
    iterations_per_epoch: int = 250
    val_iterations: int = 50
    save_every: int = 50
    seed: int = 12345
    device_type: str = "cuda"
    num_gpus: int | None = None
    compile: bool = False
    # Recompute norm + activation in backward instead of keeping them (trainer.network.unet):
    # "auto" = on for 3D on CPU (host memory is the scarce resource), off for 2D and GPUs.
    recompute_norm: str = "auto"
    # Compute format (trainer.network.precision): "auto" = autocast on CUDA and on AMX CPUs.
    precision: str = "auto"
    num_workers: int = 2
    augment_on: str = "device"
    npz: bool = False
    continue_training: bool = False
    validation_only: bool = False
    val_best: bool = False
    # Mirroring test-time augmentation in the final validation, as nnU-Net's final
    # validation and nnui-predict's default (--val_disable_tta turns it off).
    val_mirror: bool = True
    # --val_mirror_axes: the patch axes mirrored (None: all, nnU-Net's); fewer = a quick look.
    val_mirror_axes: tuple[int, ...] | None = None
    disable_checkpointing: bool = False
    resume_checkpoint: str | None = None
    # The raw dataset folder (DatasetNNN_Name under nnUNet_raw): final validation writes
    # segmentations in its geometry and scores them against its labelsTr. None: no raw data
    # (training runs only; validation then scores in the preprocessed space).
    raw_dataset_dir: str | None = None
    pretrained_weights: str | None = None  # -pretrained_weights: a safetensors file
    initial_lr: float = 1e-2
    weight_decay: float = 3e-5
    momentum: float = 0.99
    grad_clip_norm: float = 12.0
    oversample_foreground: float = 0.33
    argv: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the flag that fixes the problem."""
        positive = {
            "--epochs": self.num_epochs,
            "--iterations-per-epoch": self.iterations_per_epoch,
            "--val-iterations": self.val_iterations,
            "--save-every": self.save_every,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise ValueError(f"{flag} must be a positive integer, got {value}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.num_gpus is not None and self.num_gpus <= 0:
            raise ValueError(f"-num_gpus must be a positive integer, got {self.num_gpus}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.fold not in FOLDS:
            raise ValueError(f"fold must be one of {', '.join(FOLDS)}, got {self.fold!r}")
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(
                f"-device must be one of {', '.join(DEVICE_TYPES)}, got {self.device_type!r}"
            )
        if self.augment_on not in AUGMENT_CHOICES:
            raise ValueError(
                f"--augment-on must be one of {', '.join(AUGMENT_CHOICES)}, got {self.augment_on!r}"
            )
        if self.recompute_norm not in RECOMPUTE_CHOICES:
            raise ValueError(
                f"--recompute-norm must be one of {', '.join(RECOMPUTE_CHOICES)}, "
                f"got {self.recompute_norm!r}"
            )
        precision.check(self.precision, self.device_type)
        if self.trainer != DEFAULT_TRAINER and not legacy.is_trainer(self.trainer):
            raise ValueError(
                f"unknown trainer {self.trainer!r}; available: {DEFAULT_TRAINER} "
                "(set epochs and iterations with --epochs / --iterations-per-epoch)"
            )
        if self.val_best and not self.validation_only:
            raise ValueError("--val_best only makes sense with --val")
        if self.pretrained_weights and (self.continue_training or self.validation_only):
            flag = "--c" if self.continue_training else "--val"
            raise ValueError(
                f"-pretrained_weights starts a new training: it cannot be combined with {flag} "
                "(continue without -pretrained_weights)"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        if known.get("val_mirror_axes") is not None:  # a JSON list after config.json
            known["val_mirror_axes"] = tuple(known["val_mirror_axes"])
        return cls(**known)

    def replace(self, **changes: Any) -> TrainConfig:
        return TrainConfig.from_dict({**self.to_dict(), **changes})

    def recomputes_norm(self, device_type: str, ndim: int = 3) -> bool:
        return recomputes_norm(self.recompute_norm, device_type, ndim)

    def identity(self) -> dict[str, str]:
        """What a checkpoint must match to be resumed by this run."""
        return {
            "dataset_name": self.dataset_name,
            "configuration": self.configuration,
            "plans_name": self.plans_name,
            "plans_identity": self.plans_identity,
            "fold": self.fold,  # a copied checkpoint of fold 1 must not continue fold 3
        }


def recomputes_norm(choice: str, device_type: str, ndim: int) -> bool:
    """auto: 3D on CPU only. A 2D batch's activations are small (peak RSS 1.3 GiB at
    nnU-Net's 80x80, batch 42) while recomputing them cost ~25 % of its CPU step; a 3D
    patch's are the CPU peak, recomputed for 6-11 % (bench/history.md)."""
    return choice == "on" or (choice == "auto" and device_type == "cpu" and ndim == 3)
