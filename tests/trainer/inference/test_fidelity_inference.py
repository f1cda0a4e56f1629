"""Inference and loss details against nnU-Net 2.8.1's own code on the same input: fold
ensembling (mean of logits, softmax after) through nnU-Net's predictor, deep-supervision
targets through batchgeneratorsv2's transform."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.inference.sliding import predict_probabilities
from trainer.network.loss import downsample_target

predict = pytest.importorskip("nnunetv2.inference.predict_from_raw_data")
ds_module = pytest.importorskip("batchgeneratorsv2.transforms.utils.deep_supervision_downsampling")


def _nnunet_predictor(network, states, patch):
    predictor = predict.nnUNetPredictor(
        tile_step_size=0.5,
        use_gaussian=True,
        use_mirroring=True,
        perform_everything_on_device=False,
        device=torch.device("cpu"),
        verbose=False,
        allow_tqdm=False,
    )
    predictor.network = network
    predictor.list_of_parameters = states
    predictor.configuration_manager = SimpleNamespace(patch_size=list(patch))
    predictor.label_manager = SimpleNamespace(num_segmentation_heads=3)
    predictor.allowed_mirroring_axes = (0, 1, 2)
    return predictor


def test_fold_ensemble_is_nnunets_mean_of_logits():
    torch.manual_seed(0)
    # pointwise: the windows' Gaussian weighting (audit row 18, centred at p // 2 there,
    # (p - 1) / 2 here) cannot change a window-independent prediction
    folds = [torch.nn.Conv3d(2, 3, 1).eval() for _ in range(2)]
    for fold in folds:  # confident folds: averaging probabilities would differ visibly
        fold.weight.data *= 8
    data = torch.randn(2, 9, 14, 13)
    patch = (6, 8, 8)
    ours = predict_probabilities(folds, data.numpy(), patch, 3, torch.device("cpu"))
    network = torch.nn.Conv3d(2, 3, 1).eval()
    predictor = _nnunet_predictor(network, [f.state_dict() for f in folds], patch)
    with torch.no_grad():
        logits = predictor.predict_logits_from_preprocessed_data(data)
    theirs = torch.softmax(logits.float(), 0)
    # nnU-Net accumulates in float16 (audit row 18): agreement to ~1e-3, except on the
    # image's outer voxels, which only window corners cover, where its Gaussian weights
    # underflow float16 (floored to its smallest value) and the logits lose their digits
    inner = (slice(None), *[slice(1, -1)] * 3)
    torch.testing.assert_close(ours[inner], theirs[inner], atol=3e-3, rtol=0)
    assert (ours.argmax(0) == theirs.argmax(0)).float().mean() > 0.99
    mean_of_probabilities = sum(
        predict_probabilities([f], data.numpy(), patch, 3, torch.device("cpu")) for f in folds
    ) / len(folds)
    assert (mean_of_probabilities - theirs)[inner].abs().max() > 0.05  # the other rule


@pytest.mark.parametrize(
    ("shape", "scales"),
    [((16, 24, 20), [1, 0.5, 0.25]), ((8, 24, 20), [[1, 1, 1], [1, 0.5, 0.5], [0.5, 0.25, 0.25]])],
)
def test_deep_supervision_targets_are_nnunets(shape, scales):
    rng = np.random.default_rng(0)
    seg = torch.from_numpy(rng.integers(0, 4, size=(1, *shape)).astype(np.int16))
    theirs = ds_module.DownsampleSegForDSTransform(scales)._apply_to_segmentation(seg)
    for target in theirs:
        ours = downsample_target(seg[None], target.shape[1:])[0]
        torch.testing.assert_close(ours, target, rtol=0, atol=0)


window_module = pytest.importorskip("nnunetv2.inference.sliding_window_prediction")


@pytest.mark.parametrize("patch", [(8, 16, 16), (9, 12, 7), (64, 64), (128, 112, 160)])
def test_gaussian_importance_and_window_starts_are_nnunets(patch):
    from trainer.inference.windows import gaussian_importance, window_starts

    theirs = window_module.compute_gaussian.__wrapped__(
        tuple(patch), dtype=torch.float32, device=torch.device("cpu")
    )
    torch.testing.assert_close(gaussian_importance(patch, torch.device("cpu")), theirs)
    image = [int(p * 2.3) + 1 for p in patch]
    steps = window_module.compute_steps_for_sliding_window(image, patch, 0.5)
    assert [window_starts(s, p) for s, p in zip(image, patch, strict=True)] == [
        list(x) for x in steps
    ]


def _smooth_logits(shape, classes: int, seed: int) -> torch.Tensor:
    """Logits that vary smoothly (structures several voxels wide) plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn((1, classes, *(max(2, n // 4) for n in shape)), generator=g) * 3
    size = tuple(shape)
    smooth = torch.nn.functional.interpolate(coarse, size=size, mode="trilinear")[0]
    return smooth + 0.05 * torch.randn((classes, *shape), generator=g)


# (stored shape, stored spacing, raw shape, raw spacing): upsampled, downsampled,
# anisotropic with the thick axis first and last (separate z: nearest along it)
EXPORT_CASES = [
    ((20, 26, 26), (1.0, 0.78125, 0.78125), (20, 25, 25), (1.0, 0.8, 0.8)),
    ((18, 30, 22), (1.0, 1.0, 1.0), (23, 21, 31), (0.8, 1.4, 0.7)),
    ((9, 30, 30), (4.0, 0.7, 0.7), (12, 26, 26), (3.0, 0.8, 0.8)),
    ((30, 30, 9), (0.7, 0.7, 4.0), (26, 26, 12), (0.8, 0.8, 3.0)),
]


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_export_labels_are_nnunets_resampled_logits(case):
    """nnui's export (slab-wise float32 resampling of log-probabilities) against nnU-Net's
    resample_data_or_seg_to_shape of the logits (float64) and argmax. Documented tolerance:
    labels are identical wherever nnU-Net's two best resampled logits differ by more than
    1e-4 (float32 rounding can only flip closer ties), and in >= 99.9 % of all voxels."""
    from trainer.inference.export import to_raw_geometry

    resampling = pytest.importorskip("nnunetv2.preprocessing.resampling.default_resampling")
    stored, spacing, raw, raw_spacing = case
    logits = _smooth_logits(stored, 3, seed=len(EXPORT_CASES) + stored[2])
    # the plans' resampling_fn_probabilities_kwargs (force_separate_z None: nnU-Net's rule)
    ref = resampling.resample_data_or_seg_to_shape(
        logits.numpy(), raw, spacing, raw_spacing, is_seg=False, order=1, order_z=0,
        force_separate_z=None,
    )  # fmt: skip
    ref = np.asarray(ref, dtype=np.float64)
    props = {
        "shape_after_cropping_and_before_resampling": list(raw),
        "shape_before_cropping": list(raw),
        "bbox_used_for_cropping": [[0, n] for n in raw],
        "spacing_after_resampling": list(spacing),
        "spacing": list(raw_spacing),
    }
    result = to_raw_geometry(torch.softmax(logits, 0), props, [0, 1, 2], keep_probabilities=True)
    assert result.segmentation.shape == raw and result.segmentation.dtype == np.uint8
    top2 = np.sort(ref, axis=0)[-2:]
    clear = (top2[1] - top2[0]) > 1e-4
    np.testing.assert_array_equal(result.segmentation[clear], ref.argmax(0)[clear])
    assert (result.segmentation == ref.argmax(0)).mean() >= 0.999
    expected = torch.softmax(torch.from_numpy(ref), 0).numpy()
    np.testing.assert_allclose(result.probabilities, expected, atol=2e-5)
