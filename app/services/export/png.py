"""A small line-plot rasterizer and PNG writer in plain Python (zlib + struct).

`nnui export` writes curves as PNG without matplotlib or numpy (app/ never imports them:
start-up stays under a second). Panels are stacked vertically; each has a title, axes,
short tick marks with their values (integer epochs on x, five even steps on y), light grid
lines, one colour per series and a legend box (colour swatch + name) in the top-right
corner. Text is drawn in a 3x5 pixel font (app.services.export.pixel_font: capitals only); the
titles, legends and exact axis ranges also go into the PNG's text chunks (tEXt) and into
`describe()`, which `nnui export` prints.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from app.services.export import pixel_font

RGB = tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
AXIS: RGB = (60, 60, 60)
GRID: RGB = (228, 228, 228)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 84, 16, 22, 34
Y_PAD = 0.04
TICK_PX, SWATCH_W, SWATCH_H, LINE_PX = 5, 22, 6, 2
TEXT_SCALE = 2  # 3x5 glyphs drawn as 6x10 pixels
TEXT_H = pixel_font.GLYPH_H * TEXT_SCALE
LEGEND_ROW_PX = TEXT_H + 4
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

    def text(self, x: int, y: int, text: str, colour: RGB = AXIS) -> None:
        pixel_font.draw_text(lambda px, py: self.dot(px, py, colour), x, y, text, TEXT_SCALE)

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


def tick_label(value: float) -> str:
    return f"{value:.3g}".replace("e-0", "e-").replace("e+0", "e")


def _axes(canvas: Canvas, box: Box) -> None:
    for tick in x_ticks(*box.x_range):
        x, _ = box.px(tick, box.y_range[0])
        canvas.line(x, box.top, x, box.bottom, GRID, 1)
        canvas.line(x, box.bottom, x, box.bottom + TICK_PX, AXIS, 1)
        label = str(tick)
        width = pixel_font.text_width(label, TEXT_SCALE)
        canvas.text(x - width // 2, box.bottom + TICK_PX + 3, label)
    low, high = box.y_range
    for k in range(5):
        y = round(box.bottom - k * (box.bottom - box.top) / 4)
        canvas.line(box.left, y, box.right, y, GRID, 1)
        canvas.line(box.left - TICK_PX, y, box.left, y, AXIS, 1)
        label = tick_label(low + k * (high - low) / 4)
        width = pixel_font.text_width(label, TEXT_SCALE)
        canvas.text(box.left - TICK_PX - 3 - width, y - TEXT_H // 2, label)
    canvas.line(box.left, box.top, box.left, box.bottom, AXIS, 1)
    canvas.line(box.left, box.bottom, box.right, box.bottom, AXIS, 1)


def _legend_corner(
    box: Box, width: int, height: int, points: list[tuple[int, int]]
) -> tuple[int, int]:
    """Top-left pixel of the legend: the corner of the plot that hides the fewest points
    (top right first when it is a tie)."""
    left, right = box.left + 8, box.right - 6 - width
    top, bottom = box.top + 6, box.bottom - 6 - height
    corners = [(right, top), (right, bottom), (left, top), (left, bottom)]

    def hidden(corner: tuple[int, int]) -> int:
        x0, y0 = corner
        return sum(x0 <= x <= x0 + width and y0 <= y <= y0 + height for x, y in points)

    return min(corners, key=hidden)


def _legend(
    canvas: Canvas, box: Box, series: Sequence[Series], points: list[tuple[int, int]]
) -> None:
    """A white box in a corner: a colour swatch and the name of each series."""
    if not series:
        return
    text_w = max(pixel_font.text_width(s.label, TEXT_SCALE) for s in series)
    width, height = SWATCH_W + text_w + 18, len(series) * LEGEND_ROW_PX + 8
    x0, y0 = _legend_corner(box, width, height, points)
    x1, y1 = x0 + width, y0 + height
    canvas.fill(x0, y0, x1, y1, WHITE)
    canvas.frame(x0, y0, x1, y1, AXIS)
    for i, item in enumerate(series):
        top = y0 + 6 + i * LEGEND_ROW_PX
        swatch_top = top + (TEXT_H - SWATCH_H) // 2
        canvas.fill(x0 + 6, swatch_top, x0 + 6 + SWATCH_W, swatch_top + SWATCH_H - 1, item.colour)
        canvas.text(x0 + 12 + SWATCH_W, top, item.label)


def _draw_panel(canvas: Canvas, panel: Panel, top: int, height: int) -> Box:
    xs = [x for s in panel.series for x in s.xs]
    ys = [y for s in panel.series for y in s.ys]
    low, high = data_range(ys)
    pad = (high - low) * Y_PAD  # the highest and lowest points stay off the frame
    box = Box(MARGIN_LEFT, top + MARGIN_TOP, canvas.width - MARGIN_RIGHT,
              top + height - MARGIN_BOTTOM, data_range(xs), (low - pad, high + pad))  # fmt: skip
    _axes(canvas, box)
    canvas.text(box.left, top + (MARGIN_TOP - TEXT_H) // 2, panel.title)
    every_point: list[tuple[int, int]] = []
    for item in panel.series:
        points = [box.px(x, y) for x, y in zip(item.xs, item.ys, strict=True)
                  if math.isfinite(x) and math.isfinite(y)]  # fmt: skip
        every_point += points
        for (xa, ya), (xb, yb) in itertools.pairwise(points):
            canvas.line(xa, ya, xb, yb, item.colour)
        if len(points) == 1:
            canvas.fill(points[0][0] - 2, points[0][1] - 2, points[0][0] + 2, points[0][1] + 2,
                        item.colour)  # fmt: skip
    _legend(canvas, box, panel.series, every_point)
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
