"""Trainer pieces on synthetic tensors: network, loss, schedule, metrics, config, windows."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.inference.windows import gaussian_importance, sliding_window_logits, window_starts
from trainer.network.loss import (
    DeepSupervisionLoss,
    SoftDiceLoss,
    deep_supervision_weights,
    downsample_target,
)
from trainer.network.unet import PlainConvUNet
from trainer.training.config import TrainConfig
from trainer.training.loop import nanmean, poly_lr, pseudo_dice


@pytest.mark.parametrize(
    ("ndim", "strides", "patch", "expected_shapes"),
    [
        (2, [[1, 1], [2, 2], [2, 1]], (16, 8), [(16, 8), (8, 4)]),
        (3, [[1, 1, 1], [1, 2, 2], [2, 2, 2]], (8, 16, 16), [(8, 16, 16), (8, 8, 8)]),
    ],
)
def test_unet_outputs_one_head_per_decoder_stage(ndim, strides, patch, expected_shapes) -> None:
    net = PlainConvUNet(2, 3, [4, 8, 16], [[3] * ndim] * 3, strides, [2, 2, 2], [1, 1], ndim)
    outputs = net(torch.randn(2, 2, *patch))
    assert [tuple(o.shape[2:]) for o in outputs] == expected_shapes
    assert all(o.shape[:2] == (2, 3) for o in outputs)
    norms = [m for m in net.modules() if isinstance(m, torch.nn.modules.instancenorm._InstanceNorm)]
    assert norms and all(m.affine for m in norms)
    net.deep_supervision = False
    assert net(torch.randn(1, 2, *patch)).shape == (1, 3, *patch)


@pytest.mark.parametrize(
    ("num_outputs", "expected"),
    [(1, [1.0]), (2, [1.0, 0.0]), (3, [2 / 3, 1 / 3, 0.0]), (4, [4 / 7, 2 / 7, 1 / 7, 0.0])],
)
def test_deep_supervision_weights(num_outputs: int, expected: list[float]) -> None:
    assert deep_supervision_weights(num_outputs) == pytest.approx(expected)


def test_downsampled_target_never_invents_labels() -> None:
    target = torch.randint(0, 4, (2, 1, 8, 8, 8)) * 2  # labels {0, 2, 4, 6}
    small = downsample_target(target, (4, 4, 2))
    assert small.shape == (2, 1, 4, 4, 2)
    assert set(small.unique().tolist()) <= {0, 2, 4, 6}


def test_soft_dice_perfect_prediction_and_background_excluded() -> None:
    target = torch.zeros(2, 1, 4, 4, dtype=torch.long)
    target[:, :, :2] = 1
    logits = torch.nn.functional.one_hot(target[:, 0], 2).permute(0, 3, 1, 2).float() * 100
    assert SoftDiceLoss()(logits, target).item() == pytest.approx(-1.0, abs=1e-4)
    # Background only in the target and predicted everywhere: the foreground Dice is the
    # smoothed 0/0 = 1, the background channel is not scored.
    empty = torch.zeros(1, 1, 4, 4, dtype=torch.long)
    bg_logits = torch.zeros(1, 2, 4, 4)
    bg_logits[:, 0] = 100
    assert SoftDiceLoss()(bg_logits, empty).item() == pytest.approx(-1.0, abs=1e-4)


def test_batch_dice_sums_are_passed_through_the_reducer() -> None:
    seen = []

    def reducer(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.shape)
        return t * 2  # as if a second rank held identical data

    target = torch.randint(0, 3, (2, 1, 6, 6))
    logits = torch.randn(2, 3, 6, 6)
    doubled = SoftDiceLoss(reduce_fn=reducer)(logits, target)
    assert seen == [(3, 2)]  # (intersect, pred, gt) x foreground classes
    assert doubled.item() == pytest.approx(SoftDiceLoss()(logits, target).item(), abs=1e-5)


def test_per_sample_dice_is_the_mean_of_each_samples_dice_and_never_reduced() -> None:
    """3d (nnU-Net's batch_dice False): one perfect and one empty prediction score
    (1 + 0) / 2, where the pooled batch Dice would say 2/3; no rank reduction is asked."""
    target = torch.zeros(2, 1, 4, 4, dtype=torch.long)
    target[:, :, :2] = 1
    logits = torch.zeros(2, 2, 4, 4)
    logits[0] = torch.nn.functional.one_hot(target[0, 0], 2).permute(2, 0, 1).float() * 100
    logits[1, 0] = 100  # background everywhere: foreground Dice 0
    seen = []
    per_sample = SoftDiceLoss(reduce_fn=lambda t: seen.append(t) or t, batch_dice=False)
    assert per_sample(logits, target).item() == pytest.approx(-0.5, abs=1e-4)
    assert seen == []
    assert SoftDiceLoss()(logits, target).item() == pytest.approx(-2 / 3, abs=1e-4)


def test_configurations_choose_batch_dice_as_nnunet_plans_do() -> None:
    from trainer.planning.plans import ConfigurationPlan

    def plan(patch: tuple[int, ...]) -> ConfigurationPlan:
        return ConfigurationPlan("c", "d", patch, 2, (1.0,) * 3, ("z",), (False,), None)  # type: ignore[arg-type]

    assert plan((32, 40)).batch_dice is True
    assert plan((16, 32, 32)).batch_dice is False


def test_deep_supervision_loss_is_differentiable() -> None:
    outputs = [torch.randn(2, 3, 8, 8, requires_grad=True), torch.randn(2, 3, 4, 4)]
    loss = DeepSupervisionLoss(2)(outputs, torch.randint(0, 3, (2, 1, 8, 8)))
    loss.backward()
    assert outputs[0].grad is not None and torch.isfinite(loss)


@pytest.mark.parametrize(
    ("epoch", "num_epochs", "expected"),
    [(0, 1000, 1e-2), (500, 1000, 1e-2 * 0.5**0.9), (999, 1000, 1e-2 * 0.001**0.9)],
)
def test_poly_lr(epoch: int, num_epochs: int, expected: float) -> None:
    assert poly_lr(1e-2, epoch, num_epochs) == pytest.approx(expected)


def test_pseudo_dice_and_nanmean() -> None:
    dice = pseudo_dice([5, 0], [5, 0], [0, 0])
    assert dice[0] == pytest.approx(10 / 15) and math.isnan(dice[1])
    assert nanmean(dice) == pytest.approx(10 / 15)
    assert math.isnan(nanmean([math.nan]))


BASE = dict(
    dataset_name="Dataset001_X",
    configuration="2d",
    fold="0",
    preprocessed_dataset_dir="/p",
    run_dir="/r",
    plans_identity="id",
    device_type="cpu",
)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_epochs": 0}, "--epochs"),
        ({"iterations_per_epoch": -1}, "--iterations-per-epoch"),
        ({"val_iterations": 0}, "--val-iterations"),
        ({"save_every": 0}, "--save-every"),
        ({"fold": "5"}, "fold must be one of"),
        ({"device_type": "tpu"}, "-device must be one of"),
        ({"trainer": "nnUNetTrainer_5epochs"}, "available: nnuiTrainer"),
        ({"num_workers": -1}, "--num-workers"),
        ({"val_best": True}, "--val_best"),
        ({"recompute_norm": "yes"}, "--recompute-norm"),
        ({"augment_on": "gpu"}, "--augment-on must be one of device, cpu"),
    ],
)
def test_config_rejects_bad_values_naming_the_flag(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**BASE, **change})


@pytest.mark.parametrize(
    ("choice", "device", "expected"),
    [("auto", "cpu", True), ("auto", "cuda", False), ("on", "cuda", True), ("off", "cpu", False)],
)
def test_recompute_choice_per_device(choice: str, device: str, expected: bool) -> None:
    config = TrainConfig(**{**BASE, "recompute_norm": choice})
    assert config.recomputes_norm(device) is expected


@pytest.mark.parametrize(
    ("choice", "ndim", "expected"),
    [("auto", 3, True), ("auto", 2, False), ("on", 2, True), ("off", 3, False)],
)
def test_auto_recompute_is_for_3d_on_cpu_only(choice: str, ndim: int, expected: bool) -> None:
    # 2D on CPU: small activations, recomputing them cost a quarter of the step.
    config = TrainConfig(**{**BASE, "recompute_norm": choice})
    assert config.recomputes_norm("cpu", ndim) is expected


def test_config_round_trips_through_json_dict() -> None:
    config = TrainConfig(**BASE, argv=["1", "2d", "0"])
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("size", "patch", "starts"),
    [(10, 16, [0]), (16, 16, [0]), (24, 16, [0, 8]), (30, 16, [0, 7, 14])],
)
def test_window_starts_cover_with_half_patch_steps(
    size: int, patch: int, starts: list[int]
) -> None:
    assert window_starts(size, patch) == starts


def test_gaussian_is_centred_and_positive() -> None:
    g = gaussian_importance((9, 9), torch.device("cpu"))
    assert g.max() == g[4, 4] == 1.0 and g.min() > 0


def test_sliding_window_reproduces_a_pointwise_model_exactly() -> None:
    class Pointwise(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat((x, -x), dim=1)

    images = torch.randn(3, 1, 11, 21)
    logits = sliding_window_logits(Pointwise(), images, (8, 8), num_classes=2, max_batch=5)
    assert torch.allclose(logits, torch.cat((images, -images), dim=1), atol=1e-5)


def test_cli_modules_do_not_import_torch_at_module_level() -> None:
    """The SIGUSR1 handler must be installed before torch is imported (docs/contract.md)."""
    import subprocess
    import sys

    code = (
        "import sys, trainer.run, trainer.__main__, trainer.stop, trainer.checkpoint.store; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize(
    ("disable", "expected", "absent"),
    [
        (True, "no checkpoint to continue from", "continue with --c"),
        (False, "continue with --c", "no checkpoint"),
    ],
)
def test_stop_message_matches_checkpointing(tmp_path, caplog, disable, expected, absent) -> None:
    import logging
    from types import SimpleNamespace

    from trainer.training.events import RunRecorder
    from trainer.training.loop import Checkpointer, LoopState, record_stop

    config = SimpleNamespace(disable_checkpointing=disable, run_dir=str(tmp_path))
    checkpointer = Checkpointer(config, trainee=None, recorder=None, is_main=False)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="trainer"):
        record_stop(
            LoopState(epoch_next=1), 0, RunRecorder(tmp_path, False, 2), checkpointer, False
        )
    assert expected in caplog.text and absent not in caplog.text


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_a_rank_ignores_a_late_stop_once_its_work_is_done(tmp_path, monkeypatch, outcome):
    """A stop sent to every rank can reach one after the run already ended (another rank's
    stop, short epochs): while the interpreter shuts down it must not die of SIGUSR1's
    default action (exit -10), so the worker leaves SIGUSR1 ignored when it returns."""
    import signal
    from types import SimpleNamespace

    from trainer.training import worker as worker_module

    def work(*_args):
        if outcome == "raises":
            raise RuntimeError("boom")
        return 0

    monkeypatch.setattr(worker_module, "_train_and_validate", work)
    monkeypatch.setattr(worker_module, "setup_logging", lambda rank: None)
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        topology = SimpleNamespace(global_rank=0, is_main=True)
        payload = TrainConfig(**{**BASE, "run_dir": str(tmp_path)}).to_dict()
        code = worker_module.worker(topology, payload)
        assert code == (0 if outcome == "returns" else 1)
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
