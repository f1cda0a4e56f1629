"""Every screen's key bindings, in one leaf module.

The screens bind them and the help screen lists them; keeping them here (importing only
textual) lets help, dashboard and job detail use each other's keys without importing each
other (no import cycle).
"""

from __future__ import annotations

from textual.binding import Binding

DASHBOARD_NAV = [
    Binding("enter", "detail", "Detail", id="detail"),
    Binding("question_mark", "help", "Help", key_display="?", id="help"),
    Binding("q", "quit", "Quit (jobs keep running)", id="quit"),
    # View toggles (they change nothing but the screen, so read-only has them too).
    Binding("c", "gpu_commands", "GPU commands", id="gpu-commands", show=False),
    Binding("u", "gpu_sort", "Sort GPU procs", id="gpu-sort", show=False),
    Binding("t", "toggle_theme", "Light/dark", id="theme", show=False),
]
DASHBOARD_ACTIONS = [
    Binding("l", "launch", "Launch", id="launch"),
    Binding("s", "stop", "Stop", id="stop"),
    Binding("r", "resume", "Resume", id="resume"),
    Binding("k", "kill", "Kill", id="kill"),
]
ACTION_IDS = frozenset(b.id for b in DASHBOARD_ACTIONS)

DETAIL_NAV = [
    Binding("escape", "back", "Back", id="detail-back"),
    Binding("o", "overlay", "All folds", id="detail-overlay"),
    Binding("question_mark", "help", "Help", key_display="?", id="detail-help"),
]
DETAIL_ACTIONS = [
    Binding("s", "stop", "Stop", id="detail-stop"),
    Binding("r", "resume", "Resume", id="detail-resume"),
    Binding("k", "kill", "Kill", id="detail-kill"),
]

# The keys that move focus into or out of the flags field are priority bindings: they run
# when the app takes the key, in key order, so every later key goes to the widget that has
# focus after them (app/widgets/key_order.py). The launch screen enables each one only where
# it applies (LaunchScreen.check_action): `f` types an f inside the field.
LAUNCH = [
    Binding("escape", "cancel", "Back", id="launch-back", priority=True),
    Binding("g", "go", "Go: start", id="launch-go"),
    Binding("e", "toggle_engine", "Engine nnui/nnU-Net", id="launch-engine"),
    Binding("m", "toggle_launcher", "spawn/torchrun", id="launch-ddp"),
    Binding("c", "toggle_resume", "Resume --c", id="launch-resume"),
    Binding("f", "focus_flags", "Trainer flags", id="launch-flags", priority=True),
    Binding("enter", "leave_flags", "Done", id="launch-flags-done", priority=True),
]
