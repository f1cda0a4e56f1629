"""bench/predict.py --real's set-up from a fresh work folder, on a tiny case: the raw case,
nnU-Net's plans (its own plan_experiment), nnui's plans with nnU-Net's values, and the
export stage's logits at the network's shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

pytest.importorskip("nnunetv2")


@pytest.mark.slow
def test_real_setup_builds_every_input_from_an_empty_work_folder(tmp_path):
    import predict_real

    from trainer.planning.plans import load_plans

    paths = predict_real.setup(tmp_path / "work", case_shape=(24, 48, 40))
    assert paths["image"].is_file()
    nnunet = json.loads(paths["nnunet_plans"].read_text())["configurations"]["3d_fullres"]
    nnui = load_plans(paths["nnui_plans"].parent).configuration("3d_fullres")
    assert list(nnui.patch_size) == nnunet["patch_size"]
    assert list(nnui.spacing) == pytest.approx(nnunet["spacing"])
    logits = np.load(paths["logits"])
    assert logits.shape[0] == 3 and logits.dtype == np.float32
    # The case at 1.0 x 0.78 x 0.78 mm resampled to the plan's spacing, as prepare_case does.
    spacing = (1.0, 0.78125, 0.78125)
    target = nnunet["spacing"]
    expected = [round(n * s / t) for n, s, t in zip((24, 48, 40), spacing, target, strict=True)]
    assert [abs(a - b) <= 1 for a, b in zip(logits.shape[1:], expected, strict=True)] == [True] * 3
    again = predict_real.setup(tmp_path / "work", case_shape=(24, 48, 40))  # cached: same files
    assert again["logits"] == paths["logits"]
