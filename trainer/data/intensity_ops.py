"""The intensity half of augmentation: per-channel operations on (C, *spatial) tensors
(batchgeneratorsv2's blur kernel and padding, low resolution, gamma, contrast), with
per-sample statistics summed in float64 so results do not depend on thread counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW = 4096  # elements summed in float32 per row before the float64 total (see _sum64)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (C, *spatial) as (C, rows, ROW) and the (C, rest) tail: views when x is contiguous."""
    flat = x.reshape(x.shape[0], -1)
    main = flat.shape[1] - flat.shape[1] % ROW
    return flat[:, :main].reshape(x.shape[0], -1, ROW), flat[:, main:]


def _sum64(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """(C,) float64 per-channel sums of x (C, *spatial) (of its squares with square): each
    ROW-element row in float32 by one thread, rows and tail added in float64. ~20x cheaper
    than sum(dtype=float64), which first makes a float64 copy, and as independent of the
    thread count (a reduction over rows is never split across threads)."""
    rows, tail = _rows(x)
    if square:
        part = torch.linalg.vector_norm(rows, dim=2).double().square().sum(1)
        return part + tail.double().square().sum(1)
    return rows.sum(2).sum(1, dtype=torch.float64) + tail.sum(1, dtype=torch.float64)


def _keep(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return values.to(x.dtype).view(-1, *[1] * (x.ndim - 1))


def _mean(x: torch.Tensor) -> torch.Tensor:
    """(C, 1, ...) per-channel mean of x (C, *spatial), accumulated in float64."""
    return _keep(_sum64(x) / x[0].numel(), x)


def _mean_std(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (unbiased) std, accumulated in float64; the squares are taken
    of the centred values one channel at a time (a channel-sized temporary). Measured
    against: one pass of sums and squared sums loses the std where the mean is far from 0
    (a near-constant patch), torch.var_mean per row (Welford) took 5x the CPU."""
    count = x[0].numel()
    mean = _mean(x)
    var = torch.stack([_sum64((x[c] - mean[c])[None], square=True)[0] for c in range(len(x))])
    return mean, _keep((var / max(1, count - 1)).sqrt(), x)


def blur_radius(sigma: float) -> int:
    """batchgeneratorsv2's kernel half-width: the odd size nearest to 6 sigma + 0.5 (halves
    towards n's side), so sigma 0.5 -> 3 taps, sigma 1 -> 7."""
    n = sigma * 6 + 0.5
    size = round(n)
    if size % 2 == 0:
        size = size + 1 if n - size >= 0 else size - 1
    return size // 2


def gaussian_blur(x: torch.Tensor, sigmas: list[float]) -> torch.Tensor:
    """x (*spatial) blurred by a separable Gaussian, sigmas (ndim) in voxels, edges
    reflected (batchgeneratorsv2's kernel and padding). A weighted sum of shifted views
    per axis: ~10x faster on CPU than a conv with a (k, 1, 1) kernel."""
    out = x
    for axis, sigma in enumerate(sigmas):
        radius = min(blur_radius(sigma), x.shape[axis] - 1)  # reflect needs pad < length
        taps = torch.arange(-radius, radius + 1, dtype=torch.float64)
        kernel = torch.exp(-0.5 * (taps / sigma) ** 2)
        weights = (kernel / kernel.sum()).tolist()
        pad = [0] * (2 * x.ndim)
        pad[2 * (x.ndim - 1 - axis)] = pad[2 * (x.ndim - 1 - axis) + 1] = radius
        padded = F.pad(out[None, None], pad, mode="reflect")[0, 0]
        length = x.shape[axis]
        out = padded.narrow(axis, 0, length) * weights[0]
        for k in range(1, 2 * radius + 1):
            out.add_(padded.narrow(axis, k, length), alpha=weights[k])
    return out


def low_resolution(x: torch.Tensor, zoom: float, axes: tuple[int, ...]) -> torch.Tensor:
    """x (*spatial): nearest down-sampling by `zoom` along `axes`, linear back up."""
    spatial = tuple(x.shape)
    small = tuple(max(1, round(n * zoom)) if a in axes else n for a, n in enumerate(spatial))
    mode = "trilinear" if len(spatial) == 3 else "bilinear"
    down = F.interpolate(x[None, None], size=small, mode="nearest-exact")
    return F.interpolate(down, size=spatial, mode=mode, align_corners=False)[0, 0]


def _min_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, 1, ...) per-channel minimum and maximum of x (C, *spatial) (two reductions:
    torch.aminmax over a flattened channel took 5x their CPU)."""
    dims = tuple(range(1, x.ndim))
    return x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)


def gamma_retain_stats_(x: torch.Tensor, gamma: torch.Tensor) -> None:
    """In place on x (C, *spatial): gamma on the [0, 1]-rescaled image, then mean and std
    restored (nnU-Net's retain_stats).

    ((x - lo) / span) ** gamma * span, shifted back by lo, is computed as
    exp(gamma log(x - lo) + (1 - gamma) log span) and the shift folded into the final
    scale and shift (it moves the mean only): five passes where pow with a tensor exponent
    (element by element, ~7x the CPU) and the rescaling took eight; same to ~3e-6 of the
    std."""
    mean, std = _mean_std(x)
    lo, hi = _min_max(x)
    span = (hi - lo).clamp_min(1e-7)
    # x - lo >= 0 exactly; log 0 = -inf and exp(-inf) = 0: 0 stays 0
    x.sub_(lo).log_().mul_(gamma).add_((1 - gamma) * span.log()).exp_()
    out_mean, out_std = _mean_std(x)
    # (x - out_mean) / out_std * std + mean as one scale and shift per channel: two passes
    scale = std / out_std.clamp_min(1e-7)
    x.mul_(scale).add_(mean - out_mean * scale)


def contrast_(x: torch.Tensor, factor: torch.Tensor) -> None:
    """In place on x (C, *spatial): scaled about the channel mean, kept in its old range."""
    mean = _mean(x)
    lo, hi = _min_max(x)
    x.mul_(factor).add_(mean * (1 - factor)).clamp_(min=lo, max=hi)
