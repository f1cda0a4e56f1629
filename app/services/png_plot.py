"""A small line-plot rasterizer and PNG writer in plain Python (zlib + struct).

`nnui export` writes curves as PNG without matplotlib or numpy (app/ never imports them:
start-up stays under a second). Panels are stacked vertically; each has axes, short tick
marks (integer epochs on x, five even steps on y), light grid lines, one colour per series
and a legend box of colour swatches in the top-right corner. The PNG holds no glyphs: the
titles, the legend's labels in swatch order and the axis ranges go into the PNG's own text
chunks (tEXt) and into `describe()`, which `nnui export` prints.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

RGB = tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
AXIS: RGB = (60, 60, 60)
GRID: RGB = (228, 228, 228)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 48, 16, 14, 26
TICK_PX, SWATCH_W, SWATCH_H, LINE_PX = 5, 22, 5, 2
MAX_X_TICKS = 10


@dataclass(frozen=True)
class Series:
    label: str
    colour: RGB
    xs: tuple[float, ...]
    ys: tuple[float, ...]


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]


class Canvas:
    """An RGB image in a bytearray; every drawing call clips to the image."""

    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, colour: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(colour)

    def fill(self, x0: int, y0: int, x1: int, y1: int, colour: RGB) -> None:
        for y in range(max(0, y0), min(self.height, y1 + 1)):
            for x in range(max(0, x0), min(self.width, x1 + 1)):
                self.dot(x, y, colour)

    def frame(self, x0: int, y0: int, x1: int, y1: int, colour: RGB) -> None:
        self.line(x0, y0, x1, y0, colour, 1)
        self.line(x1, y0, x1, y1, colour, 1)
        self.line(x1, y1, x0, y1, colour, 1)
        self.line(x0, y1, x0, y0, colour, 1)

    def line(self, x0: int, y0: int, x1: int, y1: int, colour: RGB, width: int = LINE_PX) -> None:
        """Bresenham, `width` pixels thick (a square pen)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for ox in range(width):
                for oy in range(width):
                    self.dot(x0 + ox, y0 + oy, colour)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def png(self, text: dict[str, str] | None = None) -> bytes:
        rows = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width])
            for y in range(self.height)
        )  # filter type 0 (none) on every row
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        chunks = [_chunk(b"IHDR", header)]
        for key, value in (text or {}).items():
            chunks.append(_chunk(b"tEXt", key.encode("latin-1") + b"\x00" + _latin1(value)))
        chunks += [_chunk(b"IDAT", zlib.compress(rows, 9)), _chunk(b"IEND", b"")]
        return PNG_SIGNATURE + b"".join(chunks)


def _latin1(text: str) -> bytes:
    return text.encode("latin-1", errors="replace")  # tEXt is Latin-1 by definition


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def data_range(values: Sequence[float]) -> tuple[float, float]:
    """(low, high) of the finite values, widened when flat or empty so it has a size."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    low, high = min(finite), max(finite)
    if high - low < 1e-12:
        pad = max(abs(low) * 0.05, 0.5)
        return low - pad, high + pad
    return low, high


def x_ticks(low: float, high: float) -> list[int]:
    first, last = math.ceil(low), math.floor(high)
    if last < first:
        return []
    step = max(1, math.ceil((last - first + 1) / MAX_X_TICKS))
    return list(range(first, last + 1, step))


@dataclass(frozen=True)
class Box:
    """A panel's plot area in pixels and the data ranges it maps."""

    left: int
    top: int
    right: int
    bottom: int
    x_range: tuple[float, float]
    y_range: tuple[float, float]

    def px(self, x: float, y: float) -> tuple[int, int]:
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        fx = (x - x0) / (x1 - x0)
        fy = (y - y0) / (y1 - y0)
        return (round(self.left + fx * (self.right - self.left)),
                round(self.bottom - fy * (self.bottom - self.top)))  # fmt: skip


def _axes(canvas: Canvas, box: Box) -> None:
    for tick in x_ticks(*box.x_range):
        x, _ = box.px(tick, box.y_range[0])
        canvas.line(x, box.top, x, box.bottom, GRID, 1)
        canvas.line(x, box.bottom, x, box.bottom + TICK_PX, AXIS, 1)
    for k in range(5):
        y = round(box.bottom - k * (box.bottom - box.top) / 4)
        canvas.line(box.left, y, box.right, y, GRID, 1)
        canvas.line(box.left - TICK_PX, y, box.left, y, AXIS, 1)
    canvas.line(box.left, box.top, box.left, box.bottom, AXIS, 1)
    canvas.line(box.left, box.bottom, box.right, box.bottom, AXIS, 1)


def _legend(canvas: Canvas, box: Box, series: Sequence[Series]) -> None:
    """A white box in the top-right corner: one colour swatch per series, in order."""
    if not series:
        return
    width, height = SWATCH_W + 12, len(series) * (SWATCH_H + 6) + 6
    x1, y0 = box.right - 6, box.top + 6
    x0, y1 = x1 - width, y0 + height
    canvas.fill(x0, y0, x1, y1, WHITE)
    canvas.frame(x0, y0, x1, y1, AXIS)
    for i, item in enumerate(series):
        top = y0 + 6 + i * (SWATCH_H + 6)
        canvas.fill(x0 + 6, top, x0 + 6 + SWATCH_W, top + SWATCH_H - 1, item.colour)


def _draw_panel(canvas: Canvas, panel: Panel, top: int, height: int) -> Box:
    xs = [x for s in panel.series for x in s.xs]
    ys = [y for s in panel.series for y in s.ys]
    box = Box(MARGIN_LEFT, top + MARGIN_TOP, canvas.width - MARGIN_RIGHT,
              top + height - MARGIN_BOTTOM, data_range(xs), data_range(ys))  # fmt: skip
    _axes(canvas, box)
    for item in panel.series:
        points = [box.px(x, y) for x, y in zip(item.xs, item.ys, strict=True)
                  if math.isfinite(x) and math.isfinite(y)]  # fmt: skip
        for (xa, ya), (xb, yb) in itertools.pairwise(points):
            canvas.line(xa, ya, xb, yb, item.colour)
        if len(points) == 1:
            canvas.fill(points[0][0] - 2, points[0][1] - 2, points[0][0] + 2, points[0][1] + 2,
                        item.colour)  # fmt: skip
    _legend(canvas, box, panel.series)
    return box


def hex_colour(colour: RGB) -> str:
    return "#" + "".join(f"{c:02x}" for c in colour)


def describe(panels: Sequence[Panel], boxes: Sequence[Box]) -> list[str]:
    """One line per panel: its title, axis ranges and the legend in swatch order."""
    lines = []
    for panel, box in zip(panels, boxes, strict=True):
        (x0, x1), (y0, y1) = box.x_range, box.y_range
        legend = ", ".join(f"{hex_colour(s.colour)} {s.label}" for s in panel.series)
        lines.append(f"{panel.title}: x (epoch) {x0:g}..{x1:g}, y {y0:.4g}..{y1:.4g}; {legend}")
    return lines


def render(
    panels: Sequence[Panel], width_px: int = 960, panel_height_px: int = 280
) -> tuple[bytes, list[str]]:
    """(PNG bytes, description lines): the panels stacked top to bottom."""
    canvas = Canvas(width_px, panel_height_px * max(1, len(panels)))
    boxes = [_draw_panel(canvas, p, i * panel_height_px, panel_height_px)
             for i, p in enumerate(panels)]  # fmt: skip
    lines = describe(panels, boxes)
    text = {"Title": "nnui curves", "Comment": "\n".join(lines)}
    return canvas.png(text), lines
