"""The sliding window of nnui-predict: window coverage, exact mirroring TTA, fold means."""

from __future__ import annotations

import itertools

import torch

from trainer.inference import sliding
from trainer.inference.sliding import (
    mirror_combinations,
    predict_probabilities,
    sliding_window_probabilities,
    windows_per_batch,
)


class Positional(torch.nn.Module):
    """Logits that depend on position (not flip-equivariant): TTA changes the result."""

    def __init__(self, num_classes: int, ndim: int):
        super().__init__()
        self.conv = (torch.nn.Conv3d if ndim == 3 else torch.nn.Conv2d)(1, num_classes, 1)
        self.ndim = ndim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spatial = x.shape[2:]
        ramp = torch.linspace(0, 1, spatial[-1]).view(*([1] * (1 + self.ndim)), -1)
        return self.conv(x) + ramp * torch.arange(self.conv.out_channels).view(
            1, -1, *[1] * self.ndim
        )


def test_mirror_combinations_are_every_subset_of_the_axes():
    assert mirror_combinations(3, True) == [(), (2,), (3,), (4,), (2, 3), (2, 4), (3, 4), (2, 3, 4)]
    assert mirror_combinations(2, True) == [(), (2,), (3,), (2, 3)]
    assert mirror_combinations(3, False) == [()]
    assert mirror_combinations(3, True, (1, 2)) == [(), (3,), (4,), (3, 4)]  # --mirror_axes 1,2
    assert mirror_combinations(2, True, (0,)) == [(), (2,)]


def test_fewer_mirror_axes_average_only_their_flips():
    torch.manual_seed(0)
    model = Positional(3, 3).eval()
    x = torch.randn(1, 1, 4, 6, 8)
    with torch.inference_mode():
        got = sliding_window_probabilities([model], x, (4, 6, 8), 3, mirror_axes=(2,))
        flipped = torch.flip(model(torch.flip(x, (4,))), (4,))
        expected = torch.softmax((model(x) + flipped) / 2, dim=1)
        # The model is flip-equivariant but for its ramp along x: a z flip changes nothing.
        z_only = sliding_window_probabilities([model], x, (4, 6, 8), 3, mirror_axes=(0,))
        plain = sliding_window_probabilities([model], x, (4, 6, 8), 3, mirror=False)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z_only, plain, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, plain)


def test_one_window_tta_equals_the_mean_of_the_unflipped_mirrored_predictions():
    torch.manual_seed(0)
    model = Positional(3, 3).eval()
    x = torch.randn(1, 1, 4, 6, 8)
    with torch.inference_mode():
        got = sliding_window_probabilities([model], x, (4, 6, 8), 3, mirror=True)
        logits = [
            torch.flip(model(torch.flip(x, axes)), axes) if axes else model(x)
            for axes in mirror_combinations(3, True)
        ]
        expected = torch.softmax(torch.stack(logits).mean(0), dim=1)
        plain = sliding_window_probabilities([model], x, (4, 6, 8), 3, mirror=False)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(plain, got)  # the ramp is not symmetric: TTA did something


def test_pointwise_model_gives_its_softmax_everywhere_whatever_the_windows():
    """Overlapping Gaussian-weighted windows (odd sizes, padding) of a model that looks at
    one voxel only must reproduce its softmax exactly: weights normalise to 1 everywhere."""
    torch.manual_seed(1)
    conv = torch.nn.Conv3d(2, 3, 1).eval()
    data = torch.randn(2, 13, 9, 21)
    for patch, step in itertools.product([(4, 8, 8), (8, 16, 16)], [0.5, 0.3, 1.0]):
        got = predict_probabilities([conv], data.numpy(), patch, 3, torch.device("cpu"), step)
        with torch.inference_mode():
            expected = torch.softmax(conv(data[None]), dim=1)[0]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_folds_average_logits_then_softmax_as_nnunet():
    torch.manual_seed(2)
    models = [torch.nn.Conv2d(1, 2, 1).eval() for _ in range(2)]
    data = torch.randn(1, 3, 10, 12)  # 2d: the 3 slices are predicted one by one
    both = predict_probabilities(models, data.numpy(), (8, 8), 2, torch.device("cpu"), mirror=False)
    single = [
        predict_probabilities([m], data.numpy(), (8, 8), 2, torch.device("cpu"), mirror=False)
        for m in models
    ]
    # each fold's log-probabilities are its logits up to a per-voxel constant, so the mean
    # of the folds' logits, softmaxed, is the softmax of the mean of their log-probabilities
    expected = torch.softmax((single[0].log() + single[1].log()) / 2, dim=0)
    torch.testing.assert_close(both, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(both, (single[0] + single[1]) / 2, atol=1e-4)
    assert both.shape == (2, 3, 10, 12)


class CountsBatches(Positional):
    """Positional logits; records the batch size of every forward pass."""

    def __init__(self, num_classes: int, ndim: int):
        super().__init__(num_classes, ndim)
        self.batch_sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(int(x.shape[0]))
        return super().forward(x)


def test_cpu_predicts_one_window_per_pass_with_the_result_of_batched_passes(monkeypatch):
    """On CPU a batch of 3D windows saves little CPU per window and multiplies the activation
    memory: one window per forward pass there, batches on a GPU and for CPU 2D windows (a
    lone small 2D window is mostly per-op overhead); same probabilities."""
    assert windows_per_batch(torch.device("cpu"), (64, 80, 80)) == 1
    assert windows_per_batch(torch.device("cuda"), (64, 80, 80)) == 5
    assert windows_per_batch(torch.device("cpu"), (64, 64)) == 64
    assert windows_per_batch(torch.device("cpu"), (256, 256)) == 4
    assert windows_per_batch(torch.device("cpu"), (1024, 1024)) == 1
    torch.manual_seed(2)
    model = CountsBatches(3, 3).eval()
    x = torch.randn(1, 1, 7, 10, 12)
    with torch.inference_mode():
        one = sliding_window_probabilities([model], x, (4, 6, 8), 3, mirror=True)
        num_windows = len(sliding._windows((7, 10, 12), (4, 6, 8), 0.5))
        assert set(model.batch_sizes) == {1} and len(model.batch_sizes) == num_windows * 8
        model.batch_sizes.clear()
        monkeypatch.setattr(sliding, "windows_per_batch", lambda device, patch: 5)
        batched = sliding_window_probabilities([model], x, (4, 6, 8), 3, mirror=True)
    assert max(model.batch_sizes) == 5
    torch.testing.assert_close(one, batched, rtol=1e-5, atol=1e-6)


def _small_unet(seed: int) -> torch.nn.Module:
    from trainer.network.unet import PlainConvUNet

    torch.manual_seed(seed)
    net = PlainConvUNet(1, 3, [4, 8], [[1, 3, 3], 3], [1, 2], [2, 2], [1], 3, False, False)
    for module in net.modules():  # non-trivial affine parameters for the norms
        if isinstance(module, torch.nn.InstanceNorm3d):
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
            torch.nn.init.uniform_(module.bias, -0.5, 0.5)
    return net.eval()


def test_channels_last_instance_norm_equals_instance_norm():
    """trainer.network.norm's inference path (one channels_last sample) gives F.instance_norm's
    result; with autograd on, or in NCDHW, it is nn.InstanceNorm3d itself."""
    from trainer.network.norm import InstanceNorm3d

    torch.manual_seed(3)
    norm = InstanceNorm3d(5, eps=1e-5, affine=True)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    torch.nn.init.uniform_(norm.bias, -0.5, 0.5)
    x = torch.randn(1, 5, 6, 7, 8) * 3 + 2
    expected = torch.nn.functional.instance_norm(x, weight=norm.weight, bias=norm.bias)
    channels_last = x.contiguous(memory_format=torch.channels_last_3d)
    with torch.inference_mode():
        got = norm(channels_last)
    assert got.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm(channels_last), expected, rtol=1e-5, atol=1e-5)


def test_bf16_channels_last_instance_norm_is_instance_norm_to_bf16_rounding():
    """Under bf16 autocast the channels_last path takes batch_norm's own statistics: the
    result is F.instance_norm's (in float64, of the same bf16 input) to bf16's rounding,
    kept in channels_last and bf16."""
    from trainer.network.norm import InstanceNorm3d

    torch.manual_seed(4)
    norm = InstanceNorm3d(6, eps=1e-5, affine=True)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    torch.nn.init.uniform_(norm.bias, -0.5, 0.5)
    x = torch.randn(1, 6, 8, 10, 12) * 3 + torch.arange(6.0).view(1, 6, 1, 1, 1) * 20
    x = x.to(torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    expected = torch.nn.functional.instance_norm(
        x.double(), weight=norm.weight.double(), bias=norm.bias.double(), eps=1e-5
    )
    with torch.inference_mode():
        got = norm(x)
    assert got.dtype == torch.bfloat16
    assert got.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=2e-2)


def test_cpu_3d_runs_channels_last_with_the_probabilities_of_the_default_layout(monkeypatch):
    assert sliding.memory_format(torch.device("cpu"), 3) == torch.channels_last_3d
    assert sliding.memory_format(torch.device("cpu"), 2) == torch.contiguous_format
    assert sliding.memory_format(torch.device("cuda"), 3) == torch.contiguous_format
    model = _small_unet(4)
    x = torch.randn(1, 1, 6, 12, 10)
    with torch.inference_mode():
        fast = sliding_window_probabilities(
            [model.to(memory_format=torch.channels_last_3d)], x, (4, 8, 8), 3
        )
        monkeypatch.setattr(sliding, "memory_format", lambda d, n: torch.contiguous_format)
        plain = sliding_window_probabilities(
            [model.to(memory_format=torch.contiguous_format)], x, (4, 8, 8), 3
        )
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast.argmax(1), plain.argmax(1))
