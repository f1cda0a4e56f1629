"""Which patch axes test-time mirroring flips: nnU-Net's default is every axis the training
mirrored (all of them: 8 passes in 3d, 4 in 2d); fewer axes are a quicker look (`--val_mirror_axes`,
`nnui-predict --mirror_axes`), e.g. `1,2` in 3d = the in-plane flips only, 4 passes.
Standard library only: the CLIs check the flag before torch loads."""

from __future__ import annotations

import argparse


def parse_axes(text: str) -> tuple[int, ...]:
    """argparse type: '0,1,2' -> (0, 1, 2); 0-based patch axes (z, y, x in 3d; y, x in 2d)."""
    try:
        axes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give patch axes as numbers, e.g. 0,1,2 (3d) or 0,1 (2d)"
        ) from None
    if not axes or any(a < 0 or a > 2 for a in axes):
        raise argparse.ArgumentTypeError(f"{text!r}: patch axes are 0, 1 or 2 (e.g. 1,2)")
    return axes


def check_axes(axes: tuple[int, ...] | None, ndim: int, flag: str) -> None:
    """ValueError naming `flag` when an axis is outside a `ndim`-D patch."""
    if axes is not None and max(axes) >= ndim:
        raise ValueError(
            f"{flag} {','.join(map(str, axes))}: the {ndim}D patch has axes 0-{ndim - 1}"
        )


def describe(enabled: bool, axes: tuple[int, ...] | None) -> str:
    if not enabled:
        return "off"
    return "on" if axes is None else f"axes {','.join(map(str, axes))}"
