"""Region-based training (issue 29, item 1): dataset.json's labels with regions, read as
nnU-Net 2.8.1 reads them; the region loss, the pseudo-Dice counts and the evaluation give
nnU-Net's numbers on the same inputs; bad region definitions are one-line errors.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from trainer.data.labels import LabelError, parse_labels, region_masks
from trainer.evaluation.evaluate import evaluate_folders
from trainer.network.label_loss import LabelAwareDiceLoss, validation_counts

BRATS = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing": [3]}
ORDER = [1, 2, 3]


def brats(ignore: bool = False):
    labels = {**BRATS, "ignore": 4} if ignore else BRATS
    return parse_labels(labels, ORDER)


def test_brats_labels_are_three_sigmoid_regions_written_back_in_order():
    spec = brats()
    assert spec.has_regions and spec.num_heads == 3
    assert spec.class_names() == ["whole tumor", "tumor core", "enhancing"]
    assert spec.foreground_keys == [(1, 2, 3), (2, 3), (3,)]
    assert spec.output_values == (0, 1, 2, 3)
    labels = np.array([[0, 1, 2, 3]])
    masks = np.stack([np.isin(labels, k) for k in spec.foreground_keys]).astype(np.float32)
    # Region probabilities of a perfect prediction give the label map back.
    assert np.array_equal(spec.to_segmentation(masks), labels)
    # nnU-Net's LabelManager agrees on every derived list.
    from nnunetv2.utilities.label_handling.label_handling import LabelManager

    manager = LabelManager(BRATS, ORDER)
    assert manager.foreground_regions == spec.foreground_keys
    assert manager.num_segmentation_heads == spec.num_heads
    probs = np.random.default_rng(0).random((3, 5, 6)).astype(np.float32)
    assert np.array_equal(
        manager.convert_probabilities_to_segmentation(probs), spec.to_segmentation(probs)
    )


def test_plain_labels_stay_softmax_labels():
    spec = parse_labels({"background": 0, "organ": 1, "lesion": 2})
    assert not spec.has_regions and spec.num_heads == 3 and spec.foreground_keys == [1, 2]
    assert spec.class_names() == ["organ", "lesion"]


@pytest.mark.parametrize(
    ("labels", "order", "message"),
    [
        (BRATS, None, "no regions_class_order"),
        (BRATS, [1, 2], "has 2 entries for 3 regions"),
        ({**BRATS, "ignore": 7}, ORDER, "ignore label (7) must be the highest label value"),
        ({"background": 0, "a": 1, "ignore": 1}, None, "ignore label (1) must be the highest"),
        ({"background": 0, "a": 1, "ignore": [2]}, None, "must be one int"),
        ({"a": 1}, None, "background as 0"),
        ({"background": 0, "a": "one"}, None, "must be an int or a list of ints"),
    ],
)
def test_bad_label_definitions_are_one_line(labels, order, message):
    with pytest.raises(LabelError, match=re.escape(message)) as caught:
        parse_labels(labels, order)
    assert "\n" not in str(caught.value)


def _nnunet_region_loss(logits, labels, spec, batch_dice, ignore):
    from nnunetv2.training.loss.compound_losses import DC_and_BCE_loss
    from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss

    loss = DC_and_BCE_loss(
        {}, {"batch_dice": batch_dice, "do_bg": True, "smooth": 1e-5, "ddp": False},
        use_ignore_label=ignore is not None, dice_class=MemoryEfficientSoftDiceLoss,
    )  # fmt: skip
    target = region_masks(labels[:, 0].long(), spec.foreground_keys)
    if ignore is not None:
        target = torch.cat((target, (labels == ignore).float()), 1)
    return loss(logits, target)


@pytest.mark.parametrize("batch_dice", [True, False])
@pytest.mark.parametrize("with_ignore", [False, True])
def test_region_loss_is_nnunets_dice_and_bce(batch_dice, with_ignore):
    spec = brats(ignore=with_ignore)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((2, 3, 6, 7, 8), generator=gen)
    labels = torch.randint(0, 5 if with_ignore else 4, (2, 1, 6, 7, 8), generator=gen)
    ours = LabelAwareDiceLoss(spec, batch_dice=batch_dice)(logits, labels)
    theirs = _nnunet_region_loss(logits, labels, spec, batch_dice, spec.ignore_label)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours, theirs)


def test_pseudo_dice_counts_are_per_region_on_the_sigmoid():
    spec = brats()
    labels = torch.tensor([[0, 1, 2, 3, 3]]).view(1, 1, 1, 1, 5)
    # Logits > 0 (sigmoid > 0.5): whole tumour everywhere, core on the last two, none enh.
    top = torch.tensor([[1.0] * 5, [-1, -1, -1, 1, 1], [-1.0] * 5]).view(1, 3, 1, 1, 5)
    tp, fp, fn = validation_counts(top, labels, spec)
    assert tp.tolist() == [4, 2, 0] and fp.tolist() == [1, 0, 0] and fn.tolist() == [0, 1, 2]


def _write(folder, case_id, array):
    import SimpleITK as sitk

    folder.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(
        sitk.GetImageFromArray(array.astype(np.uint8)), str(folder / f"{case_id}.nii.gz")
    )


def _same(ours, theirs):
    if isinstance(theirs, float) and math.isnan(theirs):
        return ours is None
    return ours == pytest.approx(theirs)


@pytest.mark.parametrize("ignore", [None, 4])
def test_region_evaluation_equals_nnunets_folder_evaluation(tmp_path, ignore):
    """compute_metrics_on_folder and nnui-evaluate on the very same files (regions, and
    regions with an ignore label): every number per case, the means and foreground_mean."""
    from nnunetv2.evaluation.evaluate_predictions import compute_metrics_on_folder
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    rng = np.random.default_rng(1)
    for i in range(3):
        reference = rng.integers(0, 5 if ignore else 4, (6, 9, 10))
        prediction = np.where(
            rng.random((6, 9, 10)) < 0.7, np.minimum(reference, 3), rng.integers(0, 4, (6, 9, 10))
        )
        if i == 2:
            reference[reference == 3] = 0  # enhancing absent: Dice undefined where not predicted
            prediction[prediction == 3] = 0
        _write(tmp_path / "ref", f"c{i}", reference)
        _write(tmp_path / "pred", f"c{i}", prediction)
    regions = brats().foreground_keys
    theirs = compute_metrics_on_folder(
        str(tmp_path / "ref"), str(tmp_path / "pred"), None, SimpleITKIO(), ".nii.gz", regions,
        ignore, num_processes=1,
    )  # fmt: skip
    ours = evaluate_folders(tmp_path / "ref", tmp_path / "pred", regions, ignore_label=ignore)
    for case_ours, case_theirs in zip(
        ours["metric_per_case"], theirs["metric_per_case"], strict=True
    ):
        for region in regions:
            for metric, value in case_theirs["metrics"][region].items():
                assert _same(case_ours["metrics"][str(region)][metric], value), (region, metric)
    for region in regions:
        for metric, value in theirs["mean"][region].items():
            assert _same(ours["mean"][str(region)][metric], float(value)), (region, metric)
    for metric, value in theirs["foreground_mean"].items():
        assert _same(ours["foreground_mean"][metric], float(value)), metric
