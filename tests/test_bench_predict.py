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


@pytest.mark.parametrize("ndim", [2, 3])
def test_nnui_weights_under_nnunets_names_give_nnunets_network_the_same_output(ndim):
    import torch
    from dynamic_network_architectures.architectures.unet import PlainConvUNet as NnunetUNet
    from nnunet_weights import to_nnunet

    from trainer.network.unet import PlainConvUNet

    features, kernels, strides = (4, 8, 16), [3, 3, 3], [1, 2, 2]
    conv = torch.nn.Conv3d if ndim == 3 else torch.nn.Conv2d
    norm = torch.nn.InstanceNorm3d if ndim == 3 else torch.nn.InstanceNorm2d
    theirs = NnunetUNet(
        2, 3, features, conv, kernels, strides, (2, 2, 2), 3, (2, 2), conv_bias=True,
        norm_op=norm, norm_op_kwargs={"eps": 1e-5, "affine": True},
        nonlin=torch.nn.LeakyReLU, nonlin_kwargs={"inplace": True, "negative_slope": 1e-2},
        deep_supervision=True,
    ).eval()  # fmt: skip
    torch.manual_seed(3)
    ours = PlainConvUNet(2, 3, features, kernels, strides, (2, 2, 2), (2, 2), ndim).eval()
    for tensor in ours.parameters():  # norms too: trained weights are not their init
        torch.nn.init.normal_(tensor, std=0.3)
    theirs.load_state_dict(to_nnunet(ours.state_dict(), list(theirs.state_dict())), strict=True)
    x = torch.randn(2, 2, *([16] * ndim))
    with torch.no_grad():
        for a, b in zip(ours(x), theirs(x), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_whole_cases_refuse_a_work_folder_of_other_weights(tmp_path):
    """A work folder's nnU-Net checkpoint is made once; asked for other weights, the set-up
    stops before it writes anything rather than time nnU-Net on a different model."""
    import predict_whole

    work = tmp_path / "work"
    work.mkdir()
    (work / "weights.json").write_text(json.dumps({"source": "random", "plans": "plan_experiment"}))
    trained = tmp_path / "checkpoint_final.safetensors"
    trained.write_bytes(b"")
    with pytest.raises(RuntimeError, match="other weights"):
        predict_whole.setup(predict_whole.CASES["ct"], work, 1, trained)
    assert sorted(p.name for p in work.iterdir()) == ["weights.json"]
    missing = predict_whole.whole_main(["--case", "ct", "--work", str(work), "--weights",
                                        str(tmp_path / "none.safetensors")])  # fmt: skip
    assert missing == 2
