"""Checkboxes and radio buttons whose state reads without colour: `[x]` / `[ ]`, `(•)` / `( )`.

Textual draws both states of a toggle as the same glyph (`▐X▌`, `▐●▌`) and tells them apart
by colour only; under NO_COLOR, in a monochrome terminal or in an SVG snapshot they look the
same. These draw the state itself (colour still added by the theme).
"""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Checkbox, RadioButton


class TextCheckbox(Checkbox):
    BUTTON_LEFT = "["
    BUTTON_RIGHT = "]"

    @property
    def _button(self) -> Content:
        self.BUTTON_INNER = "x" if self.value else " "
        return super()._button


class TextRadioButton(RadioButton):
    BUTTON_LEFT = "("
    BUTTON_RIGHT = ")"

    @property
    def _button(self) -> Content:
        self.BUTTON_INNER = "•" if self.value else " "
        return super()._button
