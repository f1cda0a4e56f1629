"""Residual-encoder U-Net presets (nnU-Net 2.8's `nnUNetPlannerResEnc{M,L,XL}`).

A preset is nnU-Net's default planner (trainer.planning.rules: target spacing, transpose,
topology, 3d_lowres search) with another network and memory reference:

- the residual-encoder U-Net (1, 3, 4, 6, 6, ... blocks per stage, one conv per decoder
  stage), whose feature-map voxels nnU-Net counts with the stem and the projections;
- the patch shrinks while one reference batch (2 in 3D, 12 in 2D) overshoots the
  reference, not a batch of 2 as in the default planner;
- a batch may cover the whole dataset (max_dataset_covered 1).

Their 2d and 3d_fullres configurations read the default plans' data (same spacing and
normalisation), as nnU-Net's presets read `nnUNetPlans_<config>/`.
"""

from __future__ import annotations

from trainer.planning.plans import RESIDUAL_ENCODER, NetworkPlan, Plans
from trainer.planning.rules import (
    NetSpec,
    Overrides,
    PlannerOptions,
    network_plan,
    plan_experiment,
    size_configuration,
)
from trainer.planning.topology import Topology
from trainer.schema.tree import DEFAULT_PLANS

BLOCKS_PER_STAGE_ENCODER = (1, 3, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6)
BLOCKS_PER_STAGE_DECODER = (1,) * 12


def _resenc(reference_3d: float, reference_2d: float, gb: float) -> NetSpec:
    return NetSpec(RESIDUAL_ENCODER, reference_3d, reference_2d, gb, BLOCKS_PER_STAGE_ENCODER,
                   BLOCKS_PER_STAGE_DECODER, 1.0, fit_min_batch=False)  # fmt: skip


# planner name -> (plans identifier, network and memory reference)
PRESETS = {
    "nnUNetPlannerResEncM": ("nnuiResEncUNetMPlans", _resenc(680_000_000, 135_000_000, 8)),
    "nnUNetPlannerResEncL": ("nnuiResEncUNetLPlans", _resenc(2_100_000_000, 380_000_000, 24)),
    "nnUNetPlannerResEncXL": ("nnuiResEncUNetXLPlans", _resenc(3_600_000_000, 560_000_000, 40)),
}
SHARED_CONFIGURATIONS = ("2d", "3d_fullres")  # their data is the default plans'


def plan_patch_and_batch(planner: str, spacing, median_shape, num_classes: int,
                         dataset_voxels: float) -> tuple[Topology, int]:  # fmt: skip
    """One configuration of a preset at its own memory target."""
    spec = PRESETS[planner][1]
    sized = size_configuration(spec, spacing, median_shape, num_classes, dataset_voxels,
                               spec.reference_gb)  # fmt: skip
    return sized.top, sized.batch


def plan_preset(fingerprint: dict, dataset_json: dict, dataset_name: str, planner: str,
                configurations: tuple[str, ...] | None = SHARED_CONFIGURATIONS,
                overrides: Overrides | None = None,
                options: PlannerOptions | None = None) -> Plans:  # fmt: skip
    """The plans of one preset (PRESETS key); 2d/3d_fullres read the default plans' data."""
    plans_name, spec = PRESETS[planner]
    options = options or PlannerOptions(planner)
    return plan_experiment(
        fingerprint, dataset_json, dataset_name, configurations, overrides,
        options.plans_name or plans_name, options, spec, data_plans=DEFAULT_PLANS,
    )  # fmt: skip


def resenc_network(top: Topology) -> NetworkPlan:
    """The presets' network for a topology (every preset builds the same one)."""
    return network_plan(top, PRESETS["nnUNetPlannerResEncM"][1])
