"""Small text formatters shared by the widgets: "n/a" for missing values, units in names."""

from __future__ import annotations

import math

NA = "n/a"
_BAR_FULL = "█"
_BAR_PARTS = " ▏▎▍▌▋▊▉"


def fmt_or_na(value: object, fmt: str = "{}") -> str:
    if value is None:
        return NA
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return fmt.format(value)


def fmt_gib(num_bytes: int | None) -> str:
    return NA if num_bytes is None else f"{num_bytes / 2**30:.1f}"


def fmt_mib(num_bytes: int | None) -> str:
    return NA if num_bytes is None else f"{num_bytes / 2**20:.0f} MiB"


def bar(fraction: float | None, width: int) -> str:
    """A fixed-width text bar with eighth-block resolution (cheap to diff, safe over SSH)."""
    if fraction is None or not math.isfinite(fraction):
        return "·" * width
    fraction = min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = _BAR_FULL * full + (_BAR_PARTS[part] if part and full < width else "")
    return text.ljust(width, "·")


def short_uuid(uuid: str) -> str:
    """`GPU-8f3a1c2d-...` -> `8f3a1c2d` (enough to tell cards apart)."""
    core = uuid.removeprefix("GPU-").removeprefix("MIG-")
    return core[:8] if core else NA


_ATTRIBUTES = ("bold", "italic", "reverse", "underline", "strike")


def readable_style(style: str, mono: bool) -> str:
    """`style`, or under NO_COLOR (`mono`) what keeps its cue readable: Textual turns each
    colour into the grey of its luminance (red, green, magenta near-black on a dark theme,
    yellow, cyan near-white on a light one) and dim into grey, so there only the text style
    on the theme's own foreground is left: an error (bold red) is bold reverse, a hint (dim)
    italic, other colours go."""
    if not mono:
        return style
    words = style.split()
    kept = [word for word in words if word in _ATTRIBUTES]
    if "dim" in words:
        kept.append("italic")
    if "bold" in words and "red" in words:
        kept.append("reverse")
    return " ".join(dict.fromkeys(kept))
