"""nnui 0.1 compatibility, in one place so that it can leave in one change.

nnui 0.1 trained under nnU-Net's own names (`-tr nnUNetTrainer -p nnUNetPlans`, plans in
`plans.json`) and wrote nnU-Net's fingerprint name. nnui still continues such runs (--c,
--val) and reads such preprocessed folders, but starts nothing new under those names.

Removal (before 1.0, once no 0.1 run folder needs continuing): delete this module and the
lines that call it (config.TrainConfig's trainer check, run._check_shared_tree,
planning.plans.load_plans, data.dataset's case list, train_args' -tr help); then
schema's LEGACY_* names and is_legacy_identifier, which the app reads too (its catalog and
launch checks) and which stay in schema because the app imports only that module.
Standard library only, like schema: every layer of the trainer may import it.
"""

from __future__ import annotations

from pathlib import Path

from trainer.schema.tree import (
    DEFAULT_PLANS,
    DEFAULT_TRAINER,
    EVENTS_FILE,
    LEGACY_FINGERPRINT_FILE,
    LEGACY_TRAINER,
    is_legacy_identifier,
)

# Fingerprint files read after nnui's own (a 0.1 preprocessed folder lists its cases there).
FINGERPRINT_FILES = (LEGACY_FINGERPRINT_FILE,)
TRAINER_HELP = f"{LEGACY_TRAINER} only continues a run made by nnui 0.1"


def is_trainer(trainer: str) -> bool:
    """A trainer name accepted besides nnui's own: 0.1's, for its runs only."""
    return trainer == LEGACY_TRAINER


def is_plans(plans_name: str) -> bool:
    """nnU-Net's plans name that nnui 0.1 wrote as its own (plans.json)."""
    return is_legacy_identifier("", plans_name)


def new_run_refusal(run_dir: Path, trainer: str, plans: str, continuing: bool) -> str | None:
    """The one-line refusal when nnU-Net's names would start anything but the continuation
    of a run that nnui 0.1 made; None when allowed."""
    if not is_legacy_identifier(trainer, plans):
        return None
    if continuing and (run_dir / EVENTS_FILE).is_file():
        return None
    return (
        f"-tr {trainer} -p {plans}: nnU-Net's names; nnui trains as -tr {DEFAULT_TRAINER} "
        f"-p {DEFAULT_PLANS} (the defaults); the old names only continue (--c, --val) a run "
        f"that nnui 0.1 made in {run_dir}"
    )
