"""A footer that shows whole key bindings only: those that do not fit are left out, never cut.

Textual's Footer lays every binding out in one row and clips at the edge (`q Quit (jobs
kee` at 80 columns). This one keeps the bindings in their declared order (the screens list
the actions first) while they fit beside the palette key, and says `…` where some were left
out (all keys stay in `?` help and the palette).
"""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.widgets import Footer
from textual.widgets._footer import FooterKey, FooterLabel

ELIDED = "…"
_PALETTE_WIDTH = 14  # `^p palette` plus its separator, docked at the right


def key_width(key: FooterKey, compact: bool) -> int:
    """Cells a FooterKey takes: ` key description ` (compact: `key description` and a margin)."""
    return len(key.key_display) + len(key.description) + (2 if compact else 3)


class FittingFooter(Footer):
    def compose(self) -> ComposeResult:
        budget = (self.size.width or self.app.size.width) - _PALETTE_WIDTH - len(ELIDED) - 1
        used = 0
        elided = False
        for widget in super().compose():
            if not isinstance(widget, FooterKey) or "-command-palette" in widget.classes:
                yield widget
                continue
            width = key_width(widget, self.compact)
            if elided or used + width > budget:
                elided = True
                continue
            used += width
            yield widget
        if elided:
            yield FooterLabel(ELIDED)

    def on_resize(self, event: events.Resize) -> None:
        if self.is_attached:
            self.call_after_refresh(self.recompose)
