"""Which trainer a job runs: nnui's own, or the real nnU-Net through nnui's extension
trainer (docs/nnunet.md). The one place that knows how the two differ for a launch: default
identifiers, plans file names, the run folder's trainer name, the entry and the modes.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

from trainer.schema.nnunet import NNUI_NNUNET_TRAINER, NNUNET_WRAP_SUFFIX
from trainer.schema.tree import DEFAULT_PLANS, DEFAULT_TRAINER, plans_file_name

NNUI, NNUNET = "nnui", "nnunet"
ENGINES = (NNUI, NNUNET)
NNUNET_DEFAULT_PLANS = "nnUNetPlans"


@dataclass(frozen=True)
class Engine:
    name: str
    default_trainer: str
    default_plans: str
    entry: tuple[str, ...]  # after sys.executable
    modes: tuple[str, ...]  # launch modes it supports
    plans_glob: str = "nnui*Plans*.json"  # its plans files in nnUNet_preprocessed/DatasetXXX/
    label: str = "nnui"  # what the board shows

    def plans_file(self, plans: str) -> str:
        return plans_file_name(plans) if self.name == NNUI else f"{plans}.json"

    def trainer_arg(self, trainer: str) -> str:
        """The -tr value to run: under nnU-Net always a `_nnui` class (stock ones cannot
        stop gracefully), so `-tr nnUNetTrainerNoMirroring` runs its nnui wrapper."""
        if self.name == NNUNET and not trainer.endswith(NNUNET_WRAP_SUFFIX):
            return trainer + NNUNET_WRAP_SUFFIX
        return trainer

    def folder_trainer(self, trainer: str) -> str:
        """The trainer part of the run folder: a wrapper trains in its base's folder."""
        if self.name == NNUNET:
            return self.trainer_arg(trainer).removesuffix(NNUNET_WRAP_SUFFIX)
        return trainer


NNUI_ENGINE = Engine(NNUI, DEFAULT_TRAINER, DEFAULT_PLANS, ("-m", "trainer"),
                     ("per_gpu", "spawn", "torchrun"))  # fmt: skip
NNUNET_ENGINE = Engine(NNUNET, NNUI_NNUNET_TRAINER, NNUNET_DEFAULT_PLANS,
                       ("-m", "trainer.nnunet_engine"), ("per_gpu", "spawn"),
                       "nnUNet*Plans*.json", "nnU-Net")  # fmt: skip


def engine(name: str) -> Engine:
    if name == NNUNET:
        return NNUNET_ENGINE
    if name == NNUI:
        return NNUI_ENGINE
    raise ValueError(f"unknown engine {name!r} (one of {', '.join(ENGINES)})")


@functools.cache
def nnunet_available() -> bool:
    """nnunetv2 importable by the interpreter nnui starts trainers with (this one)."""
    return importlib.util.find_spec("nnunetv2") is not None


# The board's one line when the engine cannot be offered.
NNUNET_MISSING_SHORT = "nnU-Net engine: nnunetv2 not installed — pip install 'nnui[nnunet]'"
NNUNET_MISSING = (
    "the nnU-Net engine needs nnunetv2 in this environment: pip install 'nnui[nnunet]' "
    "(or pip install nnunetv2==2.8.1)"
)
