"""What nnui still reads of the data earlier nnui (0.1) wrote, in one place.

Removal note (issue #26): delete this module and its three callers' branches at nnui 1.0,
when no job record, preprocessed dataset or run folder of nnui 0.1 has to be resumed or
listed any more. Until then it keeps working:
- job records without `start_ticks`: their processes are recognised by wall-clock start
  time (machine/procs.same_identity);
- nnui 0.1's plans file `plans.json`, listed as the plans nnUNetPlans (launch/catalog);
- jobs of nnui 0.1, which trained under nnU-Net's names (nnUNetTrainer__nnUNetPlans) without
  saying so: a resume names its folder's trainer and plans (launch/request.resume_request).

Standard library and trainer.schema only: any module of the app may use it.
"""

from __future__ import annotations

from pathlib import Path

from trainer.schema.tree import LEGACY_PLANS, LEGACY_PLANS_FILE, is_legacy_identifier

# Records written before start_ticks existed are compared by wall-clock start time, which
# drifts with clock adjustments: a tolerance of ~1 s (a reused pid needs a full pid-space
# wrap within that second to slip through).
CREATE_TIME_TOLERANCE_S = 1.0


def same_start_time(create_time: float, recorded_create_time: float) -> bool:
    """A process is the one an old record (no start ticks) names: same start, within 1 s."""
    return abs(create_time - recorded_create_time) <= CREATE_TIME_TOLERANCE_S


def old_plans_identifiers(folder: Path) -> set[str]:
    """nnui 0.1's `plans.json` in a preprocessed dataset folder, as its identifier."""
    return {LEGACY_PLANS} if (folder / LEGACY_PLANS_FILE).is_file() else set()


def old_identity(run_dir: str) -> tuple[str, str] | None:
    """(trainer, plans) of a run folder that nnui 0.1 named with nnU-Net's names, else None."""
    trainer, plans, _ = [*Path(run_dir).parent.name.split("__"), "", "", ""][:3]
    return (trainer, plans) if is_legacy_identifier(trainer, plans) else None
