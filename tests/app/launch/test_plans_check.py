"""`nnui launch`'s plans and configuration checks: the configuration first, then the plans;
each error names the plans and configurations that exist and the flag that picks them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.services.launch.request import LaunchRequest, check_arguments
from trainer.schema.tree import Roots

DATASET = "Dataset900_NnuiDemo"


def _roots(tmp_path: Path, plans: dict[str, list[str]]) -> Roots:
    """A preprocessed dataset holding these plans files (name -> configurations)."""
    folder = tmp_path / "pre" / DATASET
    folder.mkdir(parents=True)
    (folder / "dataset.json").write_text(json.dumps({"labels": {"background": 0}}))
    for name, configurations in plans.items():
        blocks = {c: {"batch_size": 2} for c in configurations}
        (folder / f"{name}.json").write_text(json.dumps({"configurations": blocks}))
    return Roots(tmp_path / "raw", tmp_path / "pre", tmp_path / "res")


def _errors(roots: Roots, configuration: str, *trainer_args: str) -> list[str]:
    request = LaunchRequest(dataset="900", configuration=configuration, folds=["0"], gpus=[],
                            mode="per_gpu", device="cpu", trainer_args=list(trainer_args),
                            simulated=False, engine="nnui")  # fmt: skip
    return check_arguments(request, roots)


CPU_ONLY = {"nnuiCPUPlans": ["2d", "3d_fullres"]}


def test_missing_default_plans_name_the_existing_ones_and_the_flag(tmp_path):
    """After `make demo` (CPU plans only) a launch without -p names nnuiCPUPlans."""
    errors = _errors(_roots(tmp_path, CPU_ONLY), "2d")
    assert errors == [
        f"{DATASET} has no plans nnuiPlans.json (it has nnuiCPUPlans); plans nnuiCPUPlans "
        "has 2d: add `-- -p nnuiCPUPlans`"
    ]
    assert _errors(_roots(tmp_path / "b", CPU_ONLY), "2d", "-p", "nnuiCPUPlans") == []


def test_an_unknown_configuration_is_reported_before_the_plans(tmp_path):
    errors = _errors(_roots(tmp_path, CPU_ONLY), "5d")
    assert errors == [f"unknown configuration '5d' for {DATASET} (its plans have: 2d, 3d_fullres)"]


def test_a_configuration_of_other_plans_names_them(tmp_path):
    roots = _roots(tmp_path, {"nnuiPlans": ["2d"], "nnuiCPUPlans": ["2d", "3d_fullres"]})
    errors = _errors(roots, "3d_fullres")
    assert len(errors) == 1 and "(plans nnuiPlans has: 2d)" in errors[0]
    assert errors[0].endswith("plans nnuiCPUPlans has 3d_fullres: add `-- -p nnuiCPUPlans`")


@pytest.mark.parametrize("configuration", ["2d", "5d"])
def test_a_dataset_without_plans_says_preprocess(tmp_path, configuration):
    errors = _errors(_roots(tmp_path, {}), configuration)
    assert len(errors) == 1 and "preprocess it first (nnui-preprocess" in errors[0]
