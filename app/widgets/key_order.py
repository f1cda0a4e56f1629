"""Keys handled in the order they were pressed, by the widget that had focus then.

Textual forwards a key to the focused widget at once but resolves a widget's bindings only
when the key has bubbled back up to the app, against whatever has focus *by then*. On a busy
machine focus can move in between (a later key that moves focus is handled first), and the
key would run another widget's binding, or be typed into a field meant to have lost focus
(`--val-iterations 1g`). The rule here: a key forwarded to a widget was pressed while it
had focus, so that widget handles it, on arrival. The screens make every focus change
synchronous and in key order (priority bindings, `Screen.set_focus`), so each later key is
forwarded to the right widget.
"""

from __future__ import annotations

from textual import events
from textual.widgets import Input


class KeysOnArrival:
    """Mixin for a focusable widget: run its own (non-priority) binding for a key when the
    key arrives here, not when it has bubbled back to the app."""

    async def _on_key(self, event: events.Key) -> None:
        for binding in self._bindings.key_to_bindings.get(event.key, ()):  # type: ignore[attr-defined]
            if binding.priority:
                continue
            # App.run_action says whether it ran (Widget.run_action does not).
            if await self.app.run_action(binding.action, self):  # type: ignore[attr-defined]
                event.stop()
                event.prevent_default()  # the binding ran: no default key handling
                return


class OrderedInput(KeysOnArrival, Input):
    """An Input whose editing keys (backspace, arrows, ...) act in order with the typed
    characters, even when focus has already moved on to the next widget."""
