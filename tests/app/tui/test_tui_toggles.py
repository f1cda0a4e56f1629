"""Toggles read without colour (NO_COLOR, monochrome terminals, SVG snapshots): the state is
drawn as `[x]` / `[ ]` and `(•)` / `( )`, not only coloured."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.widgets import RadioSet
from tui_fixtures import wait_for

from app.widgets.toggles import TextCheckbox, TextRadioButton


class Toggles(App):
    def compose(self) -> ComposeResult:
        yield TextCheckbox("resume (--c)", id="box")
        with RadioSet():
            yield TextRadioButton("spawn", value=True, id="spawn")
            yield TextRadioButton("torchrun", id="torchrun")


def _line(app: App, widget_id: str) -> str:
    return app.query_one(f"#{widget_id}").render().plain


async def test_toggle_states_are_drawn_as_text(monkeypatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    app = Toggles()
    async with app.run_test() as pilot:
        assert _line(app, "box").startswith("[ ] resume")
        assert _line(app, "spawn").startswith("(•) spawn")
        assert _line(app, "torchrun").startswith("( ) torchrun")
        app.query_one("#box", TextCheckbox).toggle()
        app.query_one("#torchrun", TextRadioButton).value = True
        await wait_for(lambda: _line(app, "spawn").startswith("( ) spawn"), pilot)
        assert _line(app, "box").startswith("[x] resume")
        assert _line(app, "torchrun").startswith("(•) torchrun")
