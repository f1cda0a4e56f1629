"""Shared fixtures. Data fixtures: a tiny demo dataset, raw and preprocessed (session-wide)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

# Adopted runs (app/services/jobs/discovery.py): only those under a test's own results root, so
# that trainings elsewhere on a shared box never show in another test's status or board.
os.environ.setdefault("NNUI_ADOPT_SCOPE", "roots")

DEMO_TEST_CASES = 6
DEMO_TEST_SHAPE_SCALE = 0.4  # cases of roughly 16-32 x 24-44 x 24-44 voxels
DEMO_TEST_PATCH = {"3d_fullres": (16, 32, 32), "2d": (32, 32)}
DEMO_TEST_BATCH = {"3d_fullres": 2, "2d": 4}


class DemoPreprocessed(NamedTuple):
    raw: Path  # raw root
    preprocessed: Path  # preprocessed root
    results: Path  # empty results root
    dataset_name: str  # "Dataset900_NnuiDemo"


@pytest.fixture(scope="session")
def demo_raw(tmp_path_factory) -> Path:
    """Raw root holding a 6-case demo dataset with small shapes."""
    from trainer.demo import make_demo_dataset

    root = tmp_path_factory.mktemp("raw")
    make_demo_dataset(root, num_cases=DEMO_TEST_CASES, seed=0, shape_scale=DEMO_TEST_SHAPE_SCALE)
    return root


@pytest.fixture(scope="session")
def demo_preprocessed(demo_raw, tmp_path_factory) -> DemoPreprocessed:
    """The demo preprocessed with both configurations and small patches (3d 16x32x32 batch 2,
    2d 32x32 batch 4), so trainer tests are fast: the CPU planner by name, its plans written
    as the default identifier (nnU-Net's -overwrite_plans_name) so that every test trains
    them with the trainer's default `-p`."""
    from trainer.demo import DEMO_DATASET
    from trainer.planning.preprocess import preprocess_dataset
    from trainer.planning.rules import CPU_PLANNER, Overrides, PlannerOptions
    from trainer.schema.tree import DEFAULT_PLANS

    preprocessed = tmp_path_factory.mktemp("preprocessed")
    results = tmp_path_factory.mktemp("results")
    preprocess_dataset(
        demo_raw,
        preprocessed,
        "900",
        configurations=("2d", "3d_fullres"),
        num_processes=1,
        overrides=Overrides(patch_size=dict(DEMO_TEST_PATCH), batch_size=dict(DEMO_TEST_BATCH)),
        options=PlannerOptions(CPU_PLANNER, plans_name=DEFAULT_PLANS),
    )
    return DemoPreprocessed(demo_raw, preprocessed, results, DEMO_DATASET)


def pytest_collection_modifyitems(config, items) -> None:
    """Modules with the most `slow` tests first (whole modules, order kept inside): under
    pytest-xdist (`make test`) a worker takes one module at a time, and the long end-to-end
    modules started early do not leave one worker finishing alone at the end. Then skip
    `@pytest.mark.gpu` tests where torch sees no CUDA device (torch is imported only when
    such a test was collected)."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: the collection order otherwise
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


def make_nnunet_tree(base: Path) -> dict[str, str]:
    """A tiny demo (6 cases) in nnUNet_raw under `base`, planned and preprocessed (2d) by
    the real nnU-Net; returns the environment with nnUNet_* and NNUI_STATE_DIR set there.
    Skips the calling test where nnunetv2 is not installed (make setup installs it)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("nnunetv2", reason="make setup installs nnunetv2 (extra 'nnunet')")
    from trainer.demo import make_demo_dataset

    env = {
        **os.environ,
        "nnUNet_raw": str(base / "raw"),
        "nnUNet_preprocessed": str(base / "pre"),
        "nnUNet_results": str(base / "res"),
        "NNUI_STATE_DIR": str(base / "state"),
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    make_demo_dataset(base / "raw", num_cases=6, seed=0, shape_scale=0.4)
    plan = [str(Path(sys.executable).with_name("nnUNetv2_plan_and_preprocess")), "-d", "900",
            "-c", "2d", "-np", "1"]  # fmt: skip
    done = subprocess.run(plan, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return env


@pytest.fixture(autouse=True, scope="session")
def _own_cache_dir(tmp_path_factory) -> Iterator[None]:
    """The TUI keeps a GPU history in $XDG_CACHE_HOME/nnui: tests never touch the user's.
    (Session-wide and without `monkeypatch`: an autouse monkeypatch would be undone only
    after every other fixture's teardown, later than tests that patch os.kill expect.)"""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(autouse=True, scope="session")
def _own_gpu_claims_dir(tmp_path_factory) -> Iterator[None]:
    """GPU claims (app/services/gpu_claims.py) are machine-wide flocks in /tmp by default:
    a job waiting for a free simulated GPU in one test must never wait for another test's
    job (another pytest-xdist worker, another suite on the box). Tests that need their own
    folder still set NNUI_GPU_CLAIMS_DIR themselves."""
    before = os.environ.get("NNUI_GPU_CLAIMS_DIR")
    os.environ["NNUI_GPU_CLAIMS_DIR"] = str(tmp_path_factory.mktemp("gpu-claims"))
    yield
    if before is None:
        os.environ.pop("NNUI_GPU_CLAIMS_DIR", None)
    else:
        os.environ["NNUI_GPU_CLAIMS_DIR"] = before
